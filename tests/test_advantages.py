"""Tests for agentrl_jax.advantages against hand counts and plain loops."""

import chex
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
