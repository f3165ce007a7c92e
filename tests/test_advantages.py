"""Tests for agentrl_jax.advantages against hand counts and plain loops."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import advantages as adv
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate


# -- Plain-Python references (independent of the vectorised code) -------------

def ref_group(rewards, groups, scale):
  out = []
  for i, r in enumerate(rewards):
    members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
    mu = sum(members) / len(members)
    sigma = (sum((x - mu) ** 2 for x in members) / len(members)) ** 0.5
    out.append((r - mu) / (sigma + 1e-6) if scale == "std" else r - mu)
  return out


def ref_rloo(rewards, groups):
  out = []
  for i, r in enumerate(rewards):
    others = [rewards[j] for j in range(len(rewards))
              if groups[j] == groups[i] and j != i]
    out.append(r - sum(others) / len(others) if others else 0.0)
  return out


def ref_returns(rewards, n, gamma):
  g, out = 0.0, [0.0] * len(rewards)
  for t in reversed(range(n)):
    g = rewards[t] + gamma * g
    out[t] = g
  return out


def ref_gae(rewards, values, n, terminated, gamma, lam, boot):
  out, a = [0.0] * len(rewards), 0.0
  for t in reversed(range(n)):
    v_next = values[t + 1] if t + 1 < n else (0.0 if terminated else boot)
    delta = rewards[t] + gamma * v_next - values[t]
    a = delta + gamma * lam * a
    out[t] = a
  return out


def _random_turns(rng, n=6, t=5):
  counts = rng.integers(1, t + 1, n)
  mask = (np.arange(t)[None] < counts[:, None]).astype(np.float32)
  rewards = rng.normal(size=(n, t)).astype(np.float32) * mask
  return counts, mask, rewards


# -- Trajectory level ----------------------------------------------------------

def test_exercise2_group_advantages():
  # r = [1, .5, .5, 0]: mu = 0.5; sigma = sqrt((.25 + 0 + 0 + .25) / 4)
  # = sqrt(0.125) = 0.353553; A = (r - mu) / (sigma + 1e-6)
  # = [1.414210, 0, 0, -1.414210].
  got = adv.grpo_advantages(jnp.array([1.0, 0.5, 0.5, 0.0]), jnp.zeros(4, int))
  np.testing.assert_allclose(got, [1.414210, 0, 0, -1.414210], atol=1e-5)
  # Dr.GRPO keeps the raw difference: [0.5, 0, 0, -0.5].
  got = adv.grpo_advantages(jnp.array([1.0, 0.5, 0.5, 0.0]), jnp.zeros(4, int),
                            scale="none")
  np.testing.assert_allclose(got, [0.5, 0, 0, -0.5], atol=1e-7)


@pytest.mark.parametrize("scale", adv.ADVANTAGE_SCALES)
def test_group_advantages_match_loop(scale):
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=40).astype(np.float32)
  groups = rng.integers(0, 12, 40) * 1000 + 7  # arbitrary ids, some singletons
  got = adv.grpo_advantages(jnp.asarray(rewards), jnp.asarray(groups), scale=scale)
  np.testing.assert_allclose(got, ref_group(rewards.tolist(), groups, scale),
                             rtol=1e-4, atol=1e-5)
  singles = [i for i in range(40) if (groups == groups[i]).sum() == 1]
  assert singles and np.all(np.asarray(got)[singles] == 0)
  got = adv.rloo_advantages(jnp.asarray(rewards), jnp.asarray(groups))
  np.testing.assert_allclose(got, ref_rloo(rewards.tolist(), groups),
                             rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(got)[singles] == 0)


def test_rloo_by_hand():
  # Group [1, 0, 0]: baselines are mean of the others = [0, .5, .5].
  got = adv.rloo_advantages(jnp.array([1.0, 0.0, 0.0, 3.0]), jnp.array([0, 0, 0, 1]))
  np.testing.assert_allclose(got, [1.0, -0.5, -0.5, 0.0])


def test_unknown_scale_lists_known():
  with pytest.raises(ValueError, match="known: \\('std', 'none'\\)"):
    adv.grpo_advantages(jnp.zeros(2), jnp.zeros(2, int), scale="mad")


# -- Exact group statistics (hypothesis, float64 reference) -------------------------

_ROWS = 64  # every example is padded to one static shape: one compile per function


@st.composite
def _groups(draw):
  """Groups of 1-16 rewards around offsets up to 1e3, spreads 0 or 1e-4..10.

  Flat groups use non-dyadic values (2.7, 0.3, ...), where a one-pass
  variance or a matmul mean is visibly off.
  """
  rewards, ids = [], []
  for g in range(draw(st.integers(1, 4))):
    size = draw(st.integers(1, 16))
    offset = draw(st.one_of(st.sampled_from([0.3, 2.7, -1.1, 1e3, -999.9]),
                            st.floats(-1e3, 1e3)))
    spread = draw(st.one_of(st.just(0.0), st.floats(1e-4, 10.0)))
    u = draw(st.lists(st.floats(0.0, 1.0), min_size=size, max_size=size))
    rewards += [offset + spread * x for x in u]
    ids += [1000 * g + 7] * size
  return np.asarray(rewards, np.float32), np.asarray(ids, np.int32)


def _pad_groups(rewards, ids):
  """Pads to _ROWS rows with singleton groups (which must get exactly 0)."""
  n = len(rewards)
  r = np.concatenate([rewards, np.full(_ROWS - n, 2.7, np.float32)])
  g = np.concatenate([ids, -1 - np.arange(_ROWS - n, dtype=np.int32)])
  return r, g


def _ref64(rewards, ids, kind):
  """float64 reference on the float32 inputs: grpo / drgrpo / rloo."""
  x = rewards.astype(np.float64)
  out = np.zeros_like(x)
  for g in np.unique(ids):
    sel = ids == g
    mu = x[sel].mean()
    if kind == "grpo":
      out[sel] = (x[sel] - mu) / (x[sel].std() + 1e-6)
    elif kind == "drgrpo":
      out[sel] = x[sel] - mu
    elif sel.sum() > 1:
      out[sel] = [(v - (x[sel].sum() - v) / (sel.sum() - 1)) for v in x[sel]]
  return out


_GROUP_FNS = {
    "grpo": jax.jit(adv.grpo_advantages),
    "drgrpo": jax.jit(lambda r, g: adv.grpo_advantages(r, g, scale="none")),
    "rloo": jax.jit(adv.rloo_advantages),
}


def _check_group_stats(rewards, ids):
  r, g = _pad_groups(rewards, ids)
  n = len(rewards)
  flat = np.asarray([np.all(rewards[ids == i] == rewards[ids == i][0]) for i in ids])
  for kind, fn in _GROUP_FNS.items():
    got = np.asarray(fn(jnp.asarray(r), jnp.asarray(g)))
    assert np.all(got[n:] == 0), kind  # singletons
    assert np.all(got[:n][flat] == 0), (kind, rewards[flat])  # flat groups: exactly 0
    want = _ref64(rewards, ids, kind)
    np.testing.assert_allclose(got[:n], want, rtol=1e-4, atol=1e-4, err_msg=kind)


@hypothesis.given(_groups())
@hypothesis.settings(max_examples=150, deadline=None)
def test_group_advantages_match_float64(case):
  _check_group_stats(*case)


@hypothesis.given(_groups())
@hypothesis.settings(max_examples=60, deadline=None)
def test_group_advantages_hold_under_bf16_matmul_precision(case):
  # What a TPU does by default to float32 matmuls; nothing here may depend on it.
  with jax.default_matmul_precision("bfloat16"):
    _check_group_stats(*case)


@pytest.mark.parametrize("precision", [None, "bfloat16"])
def test_flat_and_near_flat_groups_by_hand(precision):
  with jax.default_matmul_precision(precision):
    for g in (3, 5, 6, 7, 12):  # non-dyadic group sizes
      for r in (2.7, 0.3, 1e3 + 0.1):
        got = adv.grpo_advantages(jnp.full(g, r), jnp.zeros(g, jnp.int32))
        assert np.all(np.asarray(got) == 0), (g, r, got)
    # [1, 1.001]: centred +-0.0005 over std 0.0005 (+1e-6) = +-0.998.
    got = adv.grpo_advantages(jnp.array([1.0, 1.001]), jnp.zeros(2, jnp.int32))
    np.testing.assert_allclose(got, [-0.998004, 0.998004], atol=1e-5)
    # [3, 3.0005] (3.0005 is 3.00049996 in float32): +-0.996016.
    got = adv.grpo_advantages(jnp.array([3.0, 3.0005]), jnp.zeros(2, jnp.int32))
    np.testing.assert_allclose(got, [-0.996016, 0.996016], atol=1e-4)
    # Around 1000 with a spread of 0.3: standardised values, |A| <= sqrt(G - 1).
    r = np.float32(1000) + np.float32(0.3) * np.linspace(0, 1, 8, dtype=np.float32)
    got = np.asarray(adv.grpo_advantages(jnp.asarray(r), jnp.zeros(8, jnp.int32)))
    np.testing.assert_allclose(got, _ref64(r, np.zeros(8, np.int32), "grpo"), atol=1e-4)


@hypothesis.given(_groups(), st.integers(0, 2**31 - 1))
@hypothesis.settings(max_examples=60, deadline=None)
def test_group_normalize_turns_matches_float64(case, seed):
  # Each trajectory's real turns (a prefix of 1-4) all come from its group's
  # rewards; the pool is every real turn of the group.
  rewards, ids = case
  rng = np.random.default_rng(seed)
  n, t = len(rewards), 4
  counts = rng.integers(1, t + 1, n)
  mask = (np.arange(t)[None] < counts[:, None]).astype(np.float32)
  values = np.where(mask > 0, rewards[rng.permutation(n)][:, None]
                    * np.ones((1, t), np.float32), 0).astype(np.float32)
  values = np.where(mask > 0, values + rng.choice([0.0, 1e-3], (n, t)).astype(np.float32)
                    * (rng.random(n) < 0.5)[:, None], 0).astype(np.float32)
  pad = _ROWS - n
  vp = np.concatenate([values, np.full((pad, t), 2.7, np.float32)])
  mp = np.concatenate([mask, np.ones((pad, t), np.float32)])
  gp = np.concatenate([ids, -1 - np.arange(pad, dtype=np.int32)])
  for scale in adv.ADVANTAGE_SCALES:
    with jax.default_matmul_precision("bfloat16"):
      got = np.asarray(_NORMALIZE[scale](vp, mp, gp))
    assert np.all(got[n:] == 0)
    want = np.zeros((n, t))
    x = values.astype(np.float64)
    for g in np.unique(ids):
      pool = x[(ids == g)[:, None] & (mask > 0)]
      mu, sd = pool.mean(), pool.std()
      for i in np.nonzero(ids == g)[0]:
        c = (x[i, :counts[i]] - mu)
        want[i, :counts[i]] = c / (sd + 1e-6) if scale == "std" else c
      if np.all(pool == pool[0]):
        assert np.all(got[:n][ids == g] == 0)
    np.testing.assert_allclose(got[:n], want, rtol=1e-4, atol=1e-4)


_NORMALIZE = {s: jax.jit(functools.partial(adv.group_normalize_turns, scale=s))
              for s in adv.ADVANTAGE_SCALES}


# -- Turn level ----------------------------------------------------------------

def test_exercise3_returns_to_go():
  # r = [0.2, 0.0, 0.5], gamma = 0.8: G2 = 0.5; G1 = 0 + 0.8 * 0.5 = 0.4;
  # G0 = 0.2 + 0.8 * 0.4 = 0.52. Turn 0 gets the most credit.
  got = adv.discounted_returns(jnp.array([[0.2, 0.0, 0.5, 9.0]]),
                               jnp.array([[1, 1, 1, 0]]), 0.8)
  np.testing.assert_allclose(got, [[0.52, 0.4, 0.5, 0.0]], rtol=1e-6)


def test_returns_and_gae_match_loops():
  rng = np.random.default_rng(1)
  counts, mask, rewards = _random_turns(rng)
  values = rng.normal(size=mask.shape).astype(np.float32)
  terminated = rng.integers(0, 2, len(counts)).astype(bool)
  boot = rng.normal(size=len(counts)).astype(np.float32)
  gamma, lam = 0.9, 0.7
  got = adv.discounted_returns(rewards, mask, gamma)
  a, ret = adv.gae_over_turns(rewards, values, mask, terminated, gamma, lam, boot)
  for i, n in enumerate(counts):
    np.testing.assert_allclose(got[i], ref_returns(rewards[i], n, gamma), atol=1e-5)
    want = ref_gae(rewards[i], values[i], n, terminated[i], gamma, lam, boot[i])
    np.testing.assert_allclose(a[i], want, atol=1e-5)
    np.testing.assert_allclose(ret[i, :n], want[:n] + values[i, :n], atol=1e-5)
    assert np.all(np.asarray(a)[i, n:] == 0) and np.all(np.asarray(ret)[i, n:] == 0)


def test_gae_lambda_one_is_returns_minus_values():
  rng = np.random.default_rng(2)
  counts, mask, rewards = _random_turns(rng)
  values = rng.normal(size=mask.shape).astype(np.float32) * mask
  boot = rng.normal(size=len(counts)).astype(np.float32)
  gamma = 0.95
  returns = np.asarray(adv.discounted_returns(rewards, mask, gamma))
  a, _ = adv.gae_over_turns(rewards, values, mask, np.ones(len(counts), bool),
                            gamma, 1.0, boot)
  np.testing.assert_allclose(a, returns - values, atol=1e-5)
  # Truncated: the return also collects gamma^(n - t) V_boot.
  a, _ = adv.gae_over_turns(rewards, values, mask, np.zeros(len(counts), bool),
                            gamma, 1.0, boot)
  tail = gamma ** (counts[:, None] - np.arange(mask.shape[1])[None]) * boot[:, None]
  np.testing.assert_allclose(a, (returns + tail - values) * mask, atol=1e-5)


def test_gae_truncated_bootstraps_terminated_does_not():
  # One turn, r = 1, V = 0.5, gamma = 0.9, V_boot = 2:
  # terminated: A = 1 - 0.5 = 0.5; truncated: A = 1 + 0.9 * 2 - 0.5 = 2.3.
  r, v, m = jnp.array([[1.0], [1.0]]), jnp.array([[0.5], [0.5]]), jnp.ones((2, 1))
  a, ret = adv.gae_over_turns(r, v, m, jnp.array([True, False]), 0.9, 0.95,
                              jnp.array([2.0, 2.0]))
  np.testing.assert_allclose(a, [[0.5], [2.3]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[1.0], [2.8]], rtol=1e-6)


def test_branching_advantages_by_hand():
  # Terminal-only reward R = 1 after 3 turns. Continuations from s_0 succeed
  # 1/4, from s_1 2/4, from s_2 4/4: V = [.25, .5, 1]. A_t = V(s_{t+1}) - V(s_t)
  # = [.25, .5], and the last turn A_2 = R - V(s_2) = 0.
  cont = jnp.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]],
                   jnp.float32)
  cmask = jnp.ones_like(cont).at[0, 3].set(0)
  turn_rewards = jnp.array([[0.0, 0.0, 1.0, 0.0]])
  mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
  got = adv.branching_advantages(cont, cmask, turn_rewards, mask,
                                 jnp.array([True]), jnp.zeros(1))
  np.testing.assert_allclose(got, [[0.25, 0.5, 0.0, 0.0]], atol=1e-6)


def test_branching_matches_loop_with_partial_groups():
  rng = np.random.default_rng(3)
  counts, mask, rewards = _random_turns(rng)
  cont = rng.normal(size=mask.shape + (4,)).astype(np.float32)
  cmask = (rng.uniform(size=cont.shape) < 0.7).astype(np.float32)
  cmask[..., 0] = 1.0
  terminated = rng.integers(0, 2, len(counts)).astype(bool)
  boot = rng.normal(size=len(counts)).astype(np.float32)
  got = adv.branching_advantages(cont, cmask, rewards, mask, terminated, boot,
                                 gamma=0.9)
  for i, n in enumerate(counts):
    v = [sum(c * m for c, m in zip(cont[i, t], cmask[i, t])) / cmask[i, t].sum()
         for t in range(mask.shape[1])]
    for t in range(n):
      v_next = v[t + 1] if t + 1 < n else (0.0 if terminated[i] else boot[i])
      np.testing.assert_allclose(got[i, t], rewards[i, t] + 0.9 * v_next - v[t],
                                 atol=1e-5)


@pytest.mark.parametrize("scale", adv.ADVANTAGE_SCALES)
def test_group_normalize_turns_matches_loop(scale):
  rng = np.random.default_rng(4)
  counts, mask, values = _random_turns(rng, n=8)
  groups = np.array([0, 0, 0, 5, 5, 9, 2, 2])
  got = np.asarray(adv.group_normalize_turns(values, mask, groups, scale=scale))
  for i in range(8):
    pool = [values[j, t] for j in range(8) if groups[j] == groups[i]
            for t in range(counts[j])]
    mu = np.mean(pool)
    sd = np.std(pool)
    for t in range(mask.shape[1]):
      want = 0.0 if t >= counts[i] else (
          (values[i, t] - mu) / (sd + 1e-6) if scale == "std" else values[i, t] - mu)
      np.testing.assert_allclose(got[i, t], want, rtol=1e-4, atol=1e-5)


# -- Painting onto tokens -----------------------------------------------------------

def reference_assign_turn_advantage(traj, gamma):
  """The reference text's exercise 5, in numpy: G_t on each turn's tokens."""
  r = traj.turn_rewards
  g, running = [0.0] * len(r), 0.0
  for t in reversed(range(len(r))):
    running = r[t] + gamma * running
    g[t] = running
  out, turn = [], 0
  for seg in traj.segments:
    if seg.role == Role.ASSISTANT:
      out += [g[turn]] * len(seg)
      turn += 1
    else:
      out += [0.0] * len(seg)
  return np.asarray(out, np.float32)


def _trajs():
  rng = np.random.default_rng(5)
  out = []
  for n_turns in (3, 1, 2):
    segs = [Segment(Role.SYSTEM, [1, 2])]
    for _ in range(n_turns):
      k = int(rng.integers(1, 4))
      segs += [Segment(Role.ASSISTANT, [3] * k, [-0.5] * k),
               Segment(Role.OBSERVATION, [4, 4])]
    out.append(Trajectory(segs, turn_rewards=list(rng.uniform(size=n_turns)),
                          terminated=True))
  return out


@pytest.mark.parametrize("pack", [False, True])
def test_paint_turn_values_matches_exercise5(pack):
  from agentrl_jax.trajectory import turn_arrays
  trajs = _trajs()
  batch = collate(trajs, buckets=(32,), pack=pack)
  rewards, mask = turn_arrays(trajs)
  returns = adv.discounted_returns(rewards, mask, 0.9)
  painted = np.asarray(adv.paint_turn_values(returns, batch.seq_ids, batch.turn_index))
  for i, traj in enumerate(trajs):
    np.testing.assert_allclose(painted[batch.seq_ids == i],
                               reference_assign_turn_advantage(traj, 0.9), rtol=1e-6)
  assert np.all(painted[batch.seq_ids < 0] == 0)


def test_broadcast_and_out_of_range_turns():
  trajs = _trajs()
  batch = collate(trajs, buckets=(32,))
  got = np.asarray(adv.broadcast_trajectory_values(
      jnp.array([1.0, -2.0, 3.0]), batch.seq_ids, batch.turn_index))
  np.testing.assert_array_equal(got, batch.loss_mask * np.array([[1.0], [-2.0], [3.0]]))
  # Turn values too narrow for trajectory 0's three turns: NaN, not a clamp.
  painted = np.asarray(adv.paint_turn_values(jnp.ones((3, 2)), batch.seq_ids,
                                             batch.turn_index))
  assert np.isnan(painted[0][batch.turn_index[0] == 2]).all()
  assert np.isfinite(painted[1:]).all()


def _whiten_f64(a, mask):
  """veRL's masked_whiten in float64: unbiased variance, rsqrt(var + 1e-8)."""
  sel = a[mask > 0].astype(np.float64)
  return np.where(mask > 0, (a - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8), 0.0)


def test_whiten_token_advantages_by_hand_and_against_float64():
  # Action tokens 1, 2, 3, 6 among off-action ones and a padding row:
  # mean 3, unbiased variance (4 + 1 + 0 + 9) / 3 = 14 / 3.
  a = np.array([[1.0, 2.0, 9.0], [0.0, 0.0, 0.0], [3.0, -5.0, 6.0]], np.float32)
  m = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 1]], np.float32)
  s = (14 / 3) ** 0.5
  np.testing.assert_allclose(adv.whiten_token_advantages(a, m),
                             [[-2 / s, -1 / s, 0], [0, 0, 0], [0, 0, 3 / s]], rtol=1e-6)
  # Random rows far from 0, two of them padding: the population variance
  # would be off by 0.012 here, a one-pass E[x^2] - E[x]^2 in float32 by 0.26.
  rng = np.random.default_rng(0)
  a = (100.0 + 0.1 * rng.normal(size=(6, 50))).astype(np.float32)
  m = (rng.uniform(size=a.shape) < 0.6).astype(np.float32)
  m[[1, 4]] = 0.0
  np.testing.assert_allclose(adv.whiten_token_advantages(a, m), _whiten_f64(a, m),
                             atol=1e-3)
  # One action token whitens to 0 (veRL raises); none leaves all 0, no NaN.
  one = np.zeros_like(m)
  one[2, 3] = 1.0
  assert np.all(np.asarray(adv.whiten_token_advantages(a, one)) == 0)
  assert np.all(np.asarray(adv.whiten_token_advantages(a, 0 * m)) == 0)


def test_jit_equals_eager_and_traces_once():
  rng = np.random.default_rng(6)
  counts, mask, rewards = _random_turns(rng)
  values = rng.normal(size=mask.shape).astype(np.float32)
  term = np.ones(len(counts), bool)
  boot = np.zeros(len(counts), np.float32)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def both(rewards, values):
    return (adv.gae_over_turns(rewards, values, mask, term, 0.9, 0.8, boot),
            adv.grpo_advantages(rewards.sum(-1), jnp.arange(6) // 2))

  chex.clear_trace_counter()
  eager = (adv.gae_over_turns(rewards, values, mask, term, 0.9, 0.8, boot),
           adv.grpo_advantages(jnp.asarray(rewards.sum(-1)), jnp.arange(6) // 2))
  jitted = both(rewards, values)
  chex.assert_trees_all_close(jitted, eager, atol=1e-6)
  both(rewards + 1.0, values * 2.0)  # new values, same shapes: no retrace
