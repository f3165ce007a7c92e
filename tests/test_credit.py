"""Credit assignment by name, against the advantage functions and hand counts."""

import numpy as np
import pytest

from agentrl_jax import advantages as adv
from agentrl_jax.train import credit
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate, turn_arrays


def _trajs():
  """Two groups; turn counts 2, 1, 3, 2; dense turn rewards."""
  specs = [(0, [0.0, 1.0], True), (0, [0.5], True), (1, [0.0, 0.0, 1.0], False),
           (1, [0.2, 0.0], True)]
  out = []
  for group, rewards, terminated in specs:
    segs = [Segment(Role.SYSTEM, [1, 2, 3])]
    for k in range(len(rewards)):
      segs += [Segment(Role.ASSISTANT, [10 + k] * (k + 2), [-1.0] * (k + 2)),
               Segment(Role.OBSERVATION, [7, 7])]
    out.append(Trajectory(segs, reward=sum(rewards), turn_rewards=rewards,
                          terminated=terminated, truncated=not terminated,
                          metadata={"group_id": group}))
  return out


def _per_turn(batch, i):
  """The advantage on each turn's tokens of trajectory i (asserting it is flat)."""
  values = []
  for k in range(4):
    on = (batch.seq_ids == i) & (batch.turn_index == k)
    if on.any():
      assert np.unique(batch.advantages[on]).size == 1
      values.append(float(batch.advantages[on][0]))
  return values


def test_trajectory_level_schemes():
  trajs = _trajs()
  batch = collate(trajs, buckets=(32,))
  got = credit.assign("grpo", trajs, batch)
  # Group 0 rewards [1.0, 0.5]: mean .75, population std .25 -> +-1 (eps aside).
  assert _per_turn(got, 0) == pytest.approx([1.0, 1.0], abs=1e-4)
  assert _per_turn(got, 1) == pytest.approx([-1.0], abs=1e-4)
  got = credit.assign("drgrpo", trajs, batch)
  # Group 1 rewards [1.0, 0.2]: 1.0 - mean = 0.4.
  assert _per_turn(got, 2) == pytest.approx([0.4] * 3)
  got = credit.assign("rloo", trajs, batch)
  assert _per_turn(got, 3) == pytest.approx([-0.8] * 2)  # 0.2 - 1.0
  assert np.all(got.advantages[got.loss_mask == 0] == 0)


def test_turn_level_schemes():
  trajs = _trajs()
  batch = collate(trajs, buckets=(32,), pack=True)
  got = credit.assign("turn_returns", trajs, batch, gamma=0.5)
  # Trajectory 2: rewards [0, 0, 1], gamma .5 -> returns [.25, .5, 1].
  assert _per_turn(got, 2) == pytest.approx([0.25, 0.5, 1.0])
  assert _per_turn(got, 0) == pytest.approx([0.5, 1.0])
  got = credit.assign("turn_grpo", trajs, batch, gamma=0.5)
  rewards = np.array([[0.0, 1.0, 0], [0.5, 0, 0], [0.0, 0.0, 1.0], [0.2, 0.0, 0]])
  mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], np.float32)
  want = np.asarray(adv.group_normalize_turns(
      adv.discounted_returns(rewards, mask, 0.5), mask, np.array([0, 0, 1, 1])))
  for i, n in enumerate([2, 1, 3, 2]):
    assert _per_turn(got, i) == pytest.approx(list(want[i, :n]), abs=1e-5)


def test_gae_reads_values_at_turn_starts_and_bootstraps_truncation():
  trajs = _trajs()
  batch = collate(trajs, buckets=(32,))
  # A value head that outputs 10 * (position + 1) everywhere.
  token_values = (10.0 * (batch.positions + 1)).astype(np.float32)
  values, bootstrap = credit.turn_values_from_tokens(token_values, batch, 4, 3)
  # Trajectory 0: SYSTEM at 0-2, turn 0 at 3-4 -> V(s_0) read at position 2
  # (30); obs 5-6, turn 1 at 7-9 -> V(s_1) at position 6 (70); last token 11.
  np.testing.assert_allclose(values[0], [30.0, 70.0, 0.0])
  assert bootstrap[0] == 120.0
  got = credit.assign("gae", trajs, batch, gamma=0.9, lam=0.8, num_turns=3,
                      token_values=token_values)
  turn_rewards = np.array([[0.0, 1.0, 0], [0.5, 0, 0], [0.0, 0.0, 1.0], [0.2, 0.0, 0]])
  mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], np.float32)
  a, returns = adv.gae_over_turns(turn_rewards, values * mask, mask,
                                  np.array([True, True, False, True]), 0.9, 0.8,
                                  bootstrap)
  for i, n in enumerate([2, 1, 3, 2]):
    assert _per_turn(got, i) == pytest.approx(list(np.asarray(a)[i, :n]), rel=1e-5)
  # Value targets sit exactly on the decision positions.
  assert got.returns[0, 2] == pytest.approx(float(returns[0, 0]))
  assert got.returns[0, 6] == pytest.approx(float(returns[0, 1]))
  assert np.count_nonzero(got.returns) <= 8
  with pytest.raises(ValueError, match="needs token_values"):
    credit.assign("gae", trajs, batch)
  with pytest.raises(ValueError, match="known: \\('grpo'"):
    credit.assign("vtrace", trajs, batch)


# Trajectory 2 (3 turns, truncated) with a window: turn 2 saw the prompt and
# turn 1 only (segments: S 0, A0 1, O 2, A1 3, O 4, A2 5, O 6). View 0:
# S(0-2) A0(3-4) O(5-6) A1(7-9): V(s_0) at 2 -> 30, V(s_1) at 6 -> 70. View 1:
# S(0-2) A1(3-5) O(6-7) A2(8-11) [O(12-13)]: V(s_2) at 7 -> 80. The bootstrap:
# without the final state's own window, at view 1's last token 13 -> 140 (not
# view 0's); with it (the extra entry 5, as the rollout records it when the
# window moved once more), at the end of S(0-2) A2(3-6) O(7-8) -> 90.
@pytest.mark.parametrize("starts, want_bootstrap", [([1, 1, 3], 140.0),
                                                    ([1, 1, 3, 5], 90.0)])
def test_gae_under_a_sliding_window_reads_each_turn_in_its_own_view(starts,
                                                                   want_bootstrap):
  trajs = _trajs()
  trajs[2].context_starts = starts
  for pack in (False, True):
    batch = collate(trajs, buckets=(32,), pack=pack)
    token_values = (10.0 * (batch.positions + 1)).astype(np.float32)
    values, bootstrap = credit.turn_values_from_tokens(token_values, batch, 4, 3)
    np.testing.assert_allclose(values[2], [30.0, 70.0, 80.0])
    assert bootstrap[2] == want_bootstrap
    np.testing.assert_allclose(values[0], [30.0, 70.0, 0.0])
    assert bootstrap[0] == 120.0


@pytest.mark.parametrize("pack", [False, True])
def test_gae_whitened_over_the_batchs_action_tokens_against_float64(pack):
  trajs = _trajs()
  trajs[2].context_starts = [1, 1, 3]  # turn 1 again in view 1, as context (mask 0)
  batch = collate(trajs, buckets=(32,), pack=pack, num_rows=6)  # with padding rows
  token_values = np.random.default_rng(0).normal(size=batch.tokens.shape).astype(np.float32)
  kw = dict(gamma=0.9, lam=0.8, num_turns=3, token_values=token_values)
  plain = credit.assign("gae", trajs, batch, **kw)
  got = credit.assign("gae", trajs, batch, whiten=True, **kw)
  values, bootstrap = credit.turn_values_from_tokens(token_values, batch, 4, 3)
  turn_rewards, mask = turn_arrays(trajs, 3)
  a, _ = adv.gae_over_turns(turn_rewards, values * mask, mask,
                            np.array([True, True, False, True]), 0.9, 0.8, bootstrap)
  a = np.asarray(a, np.float64)
  # Token-weighted, each action token once: turn k has k + 2 tokens, 21 in all.
  weights = mask * np.array([2.0, 3.0, 4.0])
  assert weights.sum() == got.loss_mask.sum() == 21
  mean = (weights * a).sum() / 21
  var = (weights * (a - mean) ** 2).sum() / 20
  want = (a - mean) / np.sqrt(var + 1e-8)
  for i, n in enumerate([2, 1, 3, 2]):
    assert _per_turn(plain, i) == pytest.approx(list(a[i, :n]), rel=1e-5, abs=1e-6)
    assert _per_turn(got, i) == pytest.approx(list(want[i, :n]), rel=1e-5, abs=1e-6)
  assert np.all(got.advantages[got.loss_mask == 0] == 0)
  # The value targets are the unwhitened GAE returns.
  assert np.count_nonzero(got.returns) > 0
  np.testing.assert_array_equal(got.returns, plain.returns)


def test_branching_values_from_group_members_and_continuations_by_hand():
  trajs = _trajs()  # rewards A [0, 1], B [.5] (group 0); C [0, 0, 1] truncated, D [.2, 0]
  def continuation(rewards):
    segs = [Segment(Role.SYSTEM, [1])]
    for _ in rewards:
      segs += [Segment(Role.ASSISTANT, [5], [-1.0]), Segment(Role.OBSERVATION, [7])]
    return Trajectory(segs, sum(rewards), turn_rewards=rewards, terminated=True)
  # Two continuations from A's state before turn 1: returns from t=1 of 0 and 1.
  branches = {(0, 1): [continuation([0.0, 0.0]), continuation([0.0, 0.0, 1.0])]}
  returns, mask = credit.branch_returns(trajs, branches, gamma=1.0, num_turns=3)
  assert returns.shape == (4, 3, 3)
  # V(s_0) samples are the group's returns: {1, .5} and {1, .2}.
  np.testing.assert_allclose(returns[0, 0, :2], [1.0, 0.5])
  np.testing.assert_allclose(returns[3, 0, :2], [1.0, 0.2])
  np.testing.assert_allclose(returns[0, 1], [1.0, 0.0, 1.0])  # own + 2 branches
  np.testing.assert_allclose(mask[2], [[1, 1, 0], [1, 0, 0], [1, 0, 0]])
  batch = credit.assign("branching", trajs, collate(trajs, buckets=(32,)),
                        gamma=1.0, num_turns=3, branch_values=(returns, mask))
  # A: V(s0) = .75, V(s1) = 2/3 -> A0 = 0 + 2/3 - .75, A1 = 1 - 2/3.
  assert _per_turn(batch, 0) == pytest.approx([2 / 3 - 0.75, 1 / 3], abs=1e-6)
  assert _per_turn(batch, 1) == pytest.approx([0.5 - 0.75])
  # C (truncated, bootstrap 0): V = .6, 1, 1 -> A = .4, 0, 1 - 1.
  assert _per_turn(batch, 2) == pytest.approx([0.4, 0.0, 0.0], abs=1e-6)
  assert _per_turn(batch, 3) == pytest.approx([0.2 - 0.6, 0.0], abs=1e-6)
  with pytest.raises(ValueError, match="needs branch_values"):
    credit.assign("branching", trajs, batch)


# A scheme of the test's own, registered as a user would (replace: xdist may
# import this module more than once in a worker).
@credit.register("test_turn_loo", replace=True)
def _turn_leave_one_out(x: credit.CreditInputs) -> credit.Credit:
  """Per-turn rewards minus the mean of the other turns of the same episode."""
  total = (x.turn_rewards * x.turn_mask).sum(axis=1, keepdims=True)
  count = x.turn_mask.sum(axis=1, keepdims=True)
  others = (total - x.turn_rewards) / np.maximum(count - 1, 1)
  return credit.Credit(turns=(x.turn_rewards - others) * x.turn_mask)


def test_a_registered_scheme_runs_like_a_built_in():
  assert credit.schemes()[:7] == ("grpo", "drgrpo", "rloo", "turn_returns", "turn_grpo",
                                  "gae", "branching")
  assert "test_turn_loo" in credit.schemes()
  trajs = _trajs()
  got = credit.assign("test_turn_loo", trajs, collate(trajs, buckets=(32,), pack=True))
  # Trajectory 2: rewards [0, 0, 1]; the others' means [.5, .5, 0].
  assert _per_turn(got, 2) == pytest.approx([-0.5, -0.5, 1.0])
  assert _per_turn(got, 0) == pytest.approx([-1.0, 1.0])
  assert _per_turn(got, 1) == pytest.approx([0.5])  # one turn: no others
  assert np.all(got.advantages[got.loss_mask == 0] == 0)


def test_scheme_registry_errors():
  trajs = _trajs()
  batch = collate(trajs, buckets=(32,))
  with pytest.raises(ValueError, match="already registered"):
    credit.register("grpo")(lambda x: None)
  with pytest.raises(ValueError, match=r"unknown credit scheme 'nope'; known: \('grpo'"):
    credit.assign("nope", trajs, batch)
  bad = {"test_both": credit.Credit(trajectory=np.zeros(4), turns=np.zeros((4, 3))),
         "test_shape": credit.Credit(turns=np.zeros((4, 2))),
         "test_returns": credit.Credit(turns=np.zeros((4, 3)), returns=np.zeros(4))}
  for name, out in bad.items():
    credit.register(name, replace=True)(lambda x, out=out: out)
  with pytest.raises(ValueError, match="must return one of"):
    credit.assign("test_both", trajs, batch)
  with pytest.raises(ValueError, match=r"shape \(4, 2\); expected \(4, 3\)"):
    credit.assign("test_shape", trajs, batch)
  with pytest.raises(ValueError, match="value targets of shape"):
    credit.assign("test_returns", trajs, batch)


def _gigpo_trajs(keys_c=("s0",)):
  """Group 0: A keys s0 s1, rewards 0 1; B keys s0 s2 s1, rewards 0 0 0;
  C keys `keys_c`, reward .5. Group 1: D key s0, reward 1."""
  specs = [(0, ["s0", "s1"], [0.0, 1.0]), (0, ["s0", "s2", "s1"], [0.0, 0.0, 0.0]),
           (0, list(keys_c), [0.5]), (1, ["s0"], [1.0])]
  out = []
  for group, keys, rewards in specs:
    segs = [Segment(Role.SYSTEM, [1, 2])]
    for k in range(len(rewards)):
      segs += [Segment(Role.ASSISTANT, [10 + k] * 2, [-1.0] * 2), Segment(Role.OBSERVATION, [7])]
    out.append(Trajectory(segs, reward=sum(rewards), turn_rewards=rewards, terminated=True,
                          metadata={"group_id": group, "state_keys": keys}))
  return out


def test_gigpo_by_hand():
  trajs = _gigpo_trajs()
  batch = collate(trajs, buckets=(32,), pack=True)
  got = credit.assign("gigpo", trajs, batch, gamma=1.0)
  # Episode level: group 0 returns [1, 0, .5], mean .5, population std
  # sqrt(1/6): A^E = [+-sqrt(1.5), 0]. Step groups (gamma 1, returns-to-go):
  # (0, s0): A 1, B 0, C .5 -> the same as A^E; (0, s1): A's turn 1 (1) and
  # B's turn 2 (0) -> +-1; (0, s2) is B's alone and (1, s0) D's alone -> 0.
  e = np.sqrt(1.5)
  assert _per_turn(got, 0) == pytest.approx([2 * e, e + 1], abs=1e-5)
  assert _per_turn(got, 1) == pytest.approx([-2 * e, -e, -e - 1], abs=1e-5)
  assert _per_turn(got, 2) == pytest.approx([0.0], abs=1e-5)
  assert _per_turn(got, 3) == pytest.approx([0.0], abs=1e-5)
  # Without a key C's turn forms no step group; (0, s0) is then A and B: +-1.
  trajs = _gigpo_trajs(keys_c=[None])
  got = credit.assign("gigpo", trajs, batch, gamma=1.0)
  assert _per_turn(got, 0) == pytest.approx([e + 1, e + 1], abs=1e-5)
  assert _per_turn(got, 2) == pytest.approx([0.0], abs=1e-5)


def test_gigpo_on_inputs_built_by_hand_needs_their_state_keys():
  # A scheme that builds CreditInputs itself and leaves out state_keys must
  # not get one step group of every turn of every task.
  trajs = _gigpo_trajs()
  turn_rewards, turn_mask = turn_arrays(trajs)
  inputs = dict(
      trajectories=tuple(trajs), rewards=np.asarray([t.reward for t in trajs], np.float32),
      turn_rewards=turn_rewards, turn_mask=turn_mask, group_ids=credit.group_ids_of(trajs),
      terminated=np.ones(4, bool), truncated=np.zeros(4, bool), gamma=1.0, lam=1.0)
  with pytest.raises(ValueError, match="state_keys: 0 key tuples for 4 trajectories"):
    credit.gigpo(credit.CreditInputs(**inputs))
  with pytest.raises(ValueError, match="1 key tuples for 2 trajectories"):
    credit.anchor_groups(np.array([0, 1]), [("s0",)], 1)
  # Given them: test_gigpo_by_hand's advantages.
  keys = tuple(tuple(t.metadata["state_keys"]) for t in trajs)
  got = np.asarray(credit.gigpo(credit.CreditInputs(**inputs, state_keys=keys)).turns)
  e = np.sqrt(1.5)
  np.testing.assert_allclose(got, [[2 * e, e + 1, 0], [-2 * e, -e, -e - 1], [0, 0, 0],
                                   [0, 0, 0]], atol=1e-5)


def test_gigpo_with_omega_zero_is_grpo_and_discounts_step_returns():
  trajs = _gigpo_trajs()
  batch = collate(trajs, buckets=(32,))
  credit.register("gigpo_episode_only", replace=True)(
      lambda x: credit.gigpo(x, omega=0.0))
  got = credit.assign("gigpo_episode_only", trajs, batch, gamma=0.9)
  np.testing.assert_allclose(got.advantages, credit.assign("grpo", trajs, batch).advantages,
                             atol=1e-6)
  # gamma .9: (0, s0) returns-to-go A .9, B 0, C .5: mean 1.4 / 3.
  x = np.array([0.9, 0.0, 0.5])
  step = (x - x.mean()) / x.std()
  got = credit.assign("gigpo", trajs, batch, gamma=0.9)
  e = np.sqrt(1.5)
  assert [_per_turn(got, i)[0] for i in range(3)] == pytest.approx(
      [e + step[0], -e + step[1], step[2]], abs=1e-5)


def test_gigpo_against_a_float64_reference():
  rng = np.random.default_rng(0)
  n, t = 12, 5
  rewards = rng.normal(size=n)
  groups = rng.integers(0, 3, n)
  returns = rng.normal(size=(n, t))
  lengths = rng.integers(1, t + 1, n)
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  keys = rng.integers(0, 3, (n, t))
  steps = np.asarray(groups[:, None] * 10 + keys, np.int32)
  got = np.asarray(adv.gigpo_advantages(rewards, groups.astype(np.int32), returns, steps, mask,
                                        omega=0.7))
  want = np.zeros((n, t))
  for i in range(n):
    g = groups == groups[i]
    a_e = (rewards[i] - rewards[g].mean()) / (rewards[g].std() + 1e-6) if g.sum() > 1 else 0.0
    for k in range(lengths[i]):
      same = (steps == steps[i, k]) & (mask > 0)
      vals = returns[same]
      a_s = (returns[i, k] - vals.mean()) / (vals.std() + 1e-6) if len(vals) > 1 else 0.0
      want[i, k] = a_e + 0.7 * a_s
  np.testing.assert_allclose(got, want, atol=1e-5)
