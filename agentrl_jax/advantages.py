"""Credit assignment: from rewards to per-turn and per-token advantages.

Pure, jittable functions over arrays (rlax style). Shapes: N trajectories,
T turns (padded; `turn_mask[n, t] = 1` for the trajectory's real turns, which
are always a prefix 0..n_turns-1), B x L token batches from
`trajectory.collate`.

Three regimes (reference text, "Credit Assignment"):
- trajectory level: one scalar per trajectory (`grpo_advantages`,
  `rloo_advantages`), broadcast onto all its action tokens;
- turn level: a value per turn (`discounted_returns`, `gae_over_turns`,
  `branching_advantages`), painted onto that turn's action tokens;
- optional group normalisation of turn-level values
  (`group_normalize_turns`), or both levels at once: `gigpo_advantages`
  adds turn-level advantages over the turns taken from the same state.

Painted onto tokens (`paint_turn_values`), advantages may be whitened over
the batch's action tokens (`whiten_token_advantages`, veRL's GAE default).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from agentrl_jax import masked

ADVANTAGE_SCALES = ("std", "none")


def _group_stats(x: jax.Array, mask: jax.Array, group_ids: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Centred values, population std and size of each row's group.

  Segment reductions over the group, never a matmul (a backend may run
  float32 matmuls with bf16 inputs: TPUs do by default), and a shifted
  two-pass variance: every entry first has one value of its group
  subtracted (the group's largest), which is exact for nearby values, so a
  flat group gives exactly 0 and a large common offset cancels before the
  spread is rounded; then the mean and the variance of those differences,
  in two passes.

  Args:
    x: [N, K] values (K = 1 for one scalar per trajectory).
    mask: [N, K] 1 on real entries.
    group_ids: [N] int, any integers; rows with the same id form a group.
  Returns:
    (centred [N, K], std [N], count [N]): x minus its group's mean (0 off the
    mask), and per row its group's population std and real-entry count.
  """
  n = x.shape[0]
  # Dense segment index of each row's group: any integer ids, static shape.
  _, seg = jnp.unique(group_ids, size=n, return_inverse=True)
  seg = seg.reshape(n)
  on = mask > 0
  group_sum = lambda v: jax.ops.segment_sum(v, seg, num_segments=n)[seg]
  count = group_sum(jnp.sum(on, axis=-1).astype(jnp.float32))
  safe = jnp.maximum(count, 1.0)
  row_max = jnp.max(jnp.where(on, x, -jnp.inf), axis=-1)
  shift = jax.ops.segment_max(row_max, seg, num_segments=n)[seg]
  shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
  d = jnp.where(on, x - shift[:, None], 0.0)
  mean = group_sum(jnp.sum(d, axis=-1)) / safe
  centred = jnp.where(on, d - mean[:, None], 0.0)
  var = group_sum(jnp.sum(jnp.square(centred), axis=-1)) / safe
  return centred, jnp.sqrt(var), count


def grpo_advantages(rewards: jax.Array, group_ids: jax.Array, *,
                    scale: str = "std", eps: float = 1e-6) -> jax.Array:
  """Group-relative advantage of each trajectory (GRPO, Dr.GRPO).

  A_i = (r_i - mean_g r) / (std_g r + eps) for scale="std" (Shao et al.
  2024, DeepSeekMath), with the *population* std as in the reference text
  (torch's `std(unbiased=False)`; TRL and veRL use the unbiased one, which
  differs by sqrt(G / (G - 1))). scale="none" is Dr.GRPO (Liu et al. 2025):
  A_i = r_i - mean_g r. A singleton group gets 0 either way, and so does a
  group whose rewards are all equal, exactly (see `_group_stats`).

  Args:
    rewards: [N] float, one scalar per trajectory.
    group_ids: [N] int, trajectories with the same id are rollouts of the
      same task. Pad a batch with unique ids: singletons get advantage 0.
  Returns:
    [N] float32 advantages.
  """
  if scale not in ADVANTAGE_SCALES:
    raise ValueError(f"unknown scale {scale!r}; known: {ADVANTAGE_SCALES}")
  chex.assert_rank([rewards, group_ids], 1)
  chex.assert_equal_shape([rewards, group_ids])
  chex.assert_type(group_ids, int)
  rewards = rewards.astype(jnp.float32)[:, None]
  centred, std, _ = _group_stats(rewards, jnp.ones_like(rewards), group_ids)
  if scale == "none":
    return centred[:, 0]
  return centred[:, 0] / (std + eps)


def rloo_advantages(rewards: jax.Array, group_ids: jax.Array) -> jax.Array:
  """REINFORCE leave-one-out: A_i = r_i - mean_{j != i, same group} r_j.

  (Ahmadian et al. 2024.) Computed through the identity A_i = G / (G - 1) *
  (r_i - mean_g r) from the same exact group statistics as
  `grpo_advantages`. A singleton group has no other member to form a
  baseline and gets 0.

  Args:
    rewards: [N] float. group_ids: [N] int.
  Returns:
    [N] float32.
  """
  chex.assert_rank([rewards, group_ids], 1)
  chex.assert_equal_shape([rewards, group_ids])
  chex.assert_type(group_ids, int)
  rewards = rewards.astype(jnp.float32)[:, None]
  centred, _, count = _group_stats(rewards, jnp.ones_like(rewards), group_ids)
  return jnp.where(count > 1, centred[:, 0] * (count / jnp.maximum(count - 1.0, 1.0)),
                   0.0)


def _reverse_scan(step, init, xs):
  """lax.scan over the turn axis (axis 1 of every [N, T] input) backwards."""
  xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs)
  _, ys = jax.lax.scan(step, init, xs, reverse=True)
  return jnp.swapaxes(ys, 0, 1)


def discounted_returns(turn_rewards: jax.Array, turn_mask: jax.Array,
                       gamma: float) -> jax.Array:
  """Per-turn return-to-go G_t = sum_{k=t}^{n-1} gamma^(k-t) r_k.

  Args:
    turn_rewards: [N, T] reward of each turn's action.
    turn_mask: [N, T] 1 on real turns (a prefix), 0 on padding turns.
    gamma: discount between turns.
  Returns:
    [N, T] float32 returns, 0 on padding turns.
  """
  chex.assert_rank([turn_rewards, turn_mask], 2)
  chex.assert_equal_shape([turn_rewards, turn_mask])
  rewards = turn_rewards.astype(jnp.float32)
  mask = turn_mask.astype(jnp.float32)

  def step(future, x):
    r, m = x
    g = m * (r + gamma * future)
    return g, g

  return _reverse_scan(step, jnp.zeros(rewards.shape[0]), (rewards, mask))


def gae_over_turns(turn_rewards: jax.Array, values: jax.Array,
                   turn_mask: jax.Array, terminated: jax.Array, gamma: float,
                   lam: float, bootstrap_values: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation where the step is a whole turn.

  delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1}
  (Schulman et al. 2016), with V_t the value of the state before turn t's
  action. After the last real turn the next value is 0 if the episode
  terminated and `bootstrap_values` if it was truncated (or is still
  running): a truncated return is only a lower bound on what the policy
  would have achieved. With lam = 1 and a terminated episode,
  A_t = G_t - V_t (`discounted_returns` minus values).

  Args:
    turn_rewards: [N, T] per-turn rewards.
    values: [N, T] V(s_t) from the value head at each turn's start.
    turn_mask: [N, T] 1 on real turns (a prefix).
    terminated: [N] bool, the task really ended after the last real turn.
    gamma, lam: discount and GAE lambda.
    bootstrap_values: [N] V of the state after the last real turn (used only
      for trajectories that did not terminate).
  Returns:
    (advantages [N, T], returns [N, T] = advantages + values), both float32
    and 0 on padding turns.
  """
  chex.assert_rank([turn_rewards, values, turn_mask], 2)
  chex.assert_equal_shape([turn_rewards, values, turn_mask])
  chex.assert_rank([terminated, bootstrap_values], 1)
  rewards = turn_rewards.astype(jnp.float32)
  values = values.astype(jnp.float32)
  mask = turn_mask.astype(jnp.float32)
  pad = jnp.zeros_like(mask[:, :1])
  next_mask = jnp.concatenate([mask[:, 1:], pad], axis=1)
  next_values = jnp.concatenate([values[:, 1:], pad], axis=1)
  tail = jnp.where(terminated, 0.0, bootstrap_values.astype(jnp.float32))
  next_values = jnp.where(next_mask > 0, next_values, tail[:, None])
  deltas = mask * (rewards + gamma * next_values - values)

  def step(future, x):
    delta, m_next = x
    adv = delta + gamma * lam * m_next * future
    return adv, adv

  advantages = _reverse_scan(step, jnp.zeros(rewards.shape[0]),
                             (deltas, next_mask))
  advantages = mask * advantages
  return advantages, mask * (advantages + values)


def branching_advantages(continuation_returns: jax.Array,
                         continuation_mask: jax.Array,
                         turn_rewards: jax.Array, turn_mask: jax.Array,
                         terminated: jax.Array, bootstrap_values: jax.Array,
                         *, gamma: float = 1.0) -> jax.Array:
  """Critic-free per-turn advantages from branched Monte-Carlo rollouts.

  V(s_t) is estimated as the mean return of G continuations sampled from
  the same state s_t (the context just before turn t's action); the
  advantage of action t is then the TD difference it made,
  A_t = r_t + gamma * V(s_{t+1}) - V(s_t) (reference text, "Turn-level group
  baselines"), i.e. GAE with lam = 0 on Monte-Carlo values. With a
  terminal-only reward R this is V(s_{t+1}) - V(s_t) for t < n-1 and
  R - V(s_{n-1}) for the last turn.

  Args:
    continuation_returns: [N, T, G] discounted return (from turn t on,
      including turn t's own reward) of the g-th continuation from s_t.
    continuation_mask: [N, T, G] 1 where that continuation exists.
    turn_rewards, turn_mask, terminated, bootstrap_values: as in
      `gae_over_turns` (the realised trajectory's own turns).
    gamma: discount between turns.
  Returns:
    [N, T] float32 advantages, 0 on padding turns.
  """
  chex.assert_rank([continuation_returns, continuation_mask], 3)
  chex.assert_equal_shape([continuation_returns, continuation_mask])
  chex.assert_equal_shape_prefix(
      [continuation_returns, turn_rewards, turn_mask], 2)
  state_values = masked.masked_mean(
      continuation_returns.astype(jnp.float32), continuation_mask, axis=-1)
  advantages, _ = gae_over_turns(turn_rewards, state_values, turn_mask,
                                 terminated, gamma, 0.0, bootstrap_values)
  return advantages


def group_normalize_turns(turn_values: jax.Array, turn_mask: jax.Array,
                          group_ids: jax.Array, *, scale: str = "std",
                          eps: float = 1e-6) -> jax.Array:
  """Normalises per-turn values over all real turns of a task's group.

  (x - mean) / (std + eps) (population std) or x - mean for scale="none",
  where mean and std run over every real turn of every trajectory with the
  same group id, as GiGPO/turn-level GRPO variants do.

  Args:
    turn_values: [N, T] e.g. returns-to-go. turn_mask: [N, T].
    group_ids: [N] int.
  Returns:
    [N, T] float32, 0 on padding turns.
  """
  if scale not in ADVANTAGE_SCALES:
    raise ValueError(f"unknown scale {scale!r}; known: {ADVANTAGE_SCALES}")
  chex.assert_rank([turn_values, turn_mask], 2)
  chex.assert_equal_shape([turn_values, turn_mask])
  chex.assert_rank(group_ids, 1)
  chex.assert_type(group_ids, int)
  centred, std, _ = _group_stats(turn_values.astype(jnp.float32), turn_mask, group_ids)
  if scale == "std":
    centred = centred / (std[:, None] + eps)
  return centred


def gigpo_advantages(rewards: jax.Array, group_ids: jax.Array,
                     turn_returns: jax.Array, step_group_ids: jax.Array,
                     turn_mask: jax.Array, *, omega: float = 1.0,
                     scale: str = "std", eps: float = 1e-6) -> jax.Array:
  """GiGPO: episode-level plus step-level group-relative advantages.

  (Feng et al. 2025, "Group-in-Group Policy Optimization".) A[i, t] =
  A^E_i + omega * A^S[i, t]: A^E is `grpo_advantages` of the episode
  returns over the task's group; A^S normalises turn t's discounted
  return-to-go over its step group, the real turns of the task's rollouts
  taken from the same environment state (an anchor state), with the same
  scale. A step group of one turn has no baseline and gets A^S = 0, as a
  singleton task group gets A^E = 0 (verl-agent's code instead gives it its
  raw return, mean 0 and std 1). omega = 0 is GRPO. A^E's mean and std run
  over the group's trajectories, as the paper's eq. 3 has them; verl-agent
  takes them over its step rows by default (`compute_mean_std_cross_steps`),
  which weighs each trajectory by its number of turns.

  Args:
    rewards: [N] episode returns. group_ids: [N] int task groups.
    turn_returns: [N, T] discounted returns-to-go (`discounted_returns`).
    step_group_ids: [N, T] int, equal for turns of one step group (any
      value on padding turns).
    turn_mask: [N, T] 1 on real turns.
  Returns:
    [N, T] float32, 0 on padding turns.
  """
  if scale not in ADVANTAGE_SCALES:
    raise ValueError(f"unknown scale {scale!r}; known: {ADVANTAGE_SCALES}")
  chex.assert_rank([turn_returns, step_group_ids, turn_mask], 2)
  chex.assert_equal_shape([turn_returns, step_group_ids, turn_mask])
  chex.assert_type(step_group_ids, int)
  episode = grpo_advantages(rewards, group_ids, scale=scale, eps=eps)
  flat = lambda a: a.reshape(-1, 1)
  centred, std, _ = _group_stats(flat(turn_returns.astype(jnp.float32)), flat(turn_mask),
                                 step_group_ids.reshape(-1))
  step = centred[:, 0] if scale == "none" else centred[:, 0] / (std + eps)
  return (episode[:, None] + omega * step.reshape(turn_mask.shape)) * turn_mask


def paint_turn_values(turn_values: jax.Array, seq_ids: jax.Array,
                      turn_index: jax.Array) -> jax.Array:
  """Puts each turn's value on that turn's ASSISTANT tokens, 0 elsewhere.

  Args:
    turn_values: [N, T] one value per (trajectory, turn).
    seq_ids: [B, L] trajectory index of each token (-1 on padding), from
      `TokenBatch.seq_ids`; works for packed rows.
    turn_index: [B, L] turn of each ASSISTANT token, -1 elsewhere.
  Returns:
    [B, L] float32, aligned with the batch's tokens; NaN on a token whose
    (seq_id, turn) lies outside turn_values.
  """
  chex.assert_rank([turn_values, seq_ids, turn_index], 2)
  chex.assert_equal_shape([seq_ids, turn_index])
  chex.assert_type([seq_ids, turn_index], int)
  on = (seq_ids >= 0) & (turn_index >= 0)
  # Out-of-range indices (T too small for a trajectory's turns) read NaN
  # instead of jnp's default clamp, so a mismatch is loud, never silent.
  value = turn_values.astype(jnp.float32).at[
      jnp.where(on, seq_ids, 0), jnp.where(on, turn_index, 0)].get(
          mode="fill", fill_value=jnp.nan)
  return jnp.where(on, value, 0.0)


def broadcast_trajectory_values(values: jax.Array, seq_ids: jax.Array,
                                turn_index: jax.Array) -> jax.Array:
  """Puts a trajectory scalar (e.g. its GRPO advantage) on all its actions.

  Args:
    values: [N] one value per trajectory.
    seq_ids, turn_index: [B, L] as in `paint_turn_values`.
  Returns:
    [B, L] float32, 0 on non-ASSISTANT tokens and padding.
  """
  chex.assert_rank(values, 1)
  return paint_turn_values(values[:, None], seq_ids,
                           jnp.where(turn_index >= 0, 0, -1))


def whiten_token_advantages(advantages: jax.Array, action_mask: jax.Array, *,
                            eps: float = 1e-8) -> jax.Array:
  """Whitens per-token advantages over a batch's action tokens.

  A' = (A - mean) / sqrt(var + eps) on the action tokens, 0 elsewhere; mean
  and var over every action token of the batch (token-weighted: a turn of
  k tokens counts k times), var unbiased (/ (n - 1)), both two-pass in
  float32 (`masked.masked_var`). This is veRL's `compute_gae_advantage_return`:
  `masked_whiten(advantages, response_mask)` with its default
  `masked_var(unbiased=True)` and `rsqrt(var + 1e-8)` (shift_mean=True:
  the mean stays subtracted). Not `masked.masked_whiten` (population std,
  / (std + eps)). A batch of one action token whitens to 0 (veRL raises),
  one of none to all 0.

  Args:
    advantages: [B, L] per-token advantages (`paint_turn_values`).
    action_mask: [B, L] 1 on the action tokens (real and in the loss), else 0.
    eps: added to the variance.
  Returns:
    [B, L] float32 whitened advantages, 0 off the action tokens.
  """
  chex.assert_rank([advantages, action_mask], 2)
  chex.assert_equal_shape([advantages, action_mask])
  x = advantages.astype(jnp.float32)
  mean = masked.masked_mean(x, action_mask)
  var = masked.masked_var(x, action_mask, unbiased=True)
  return jnp.where(action_mask > 0, (x - mean) * jax.lax.rsqrt(var + eps), 0.0)
