"""Credit assignment by name: rollouts + collated batch -> per-token advantages.

The registry researchers swap in configs (`CREDIT_SCHEMES`):

  grpo          trajectory-level group-relative, population std (GRPO)
  drgrpo        the same without the std division (Dr.GRPO)
  rloo          leave-one-out baseline
  turn_returns  per-turn discounted return-to-go on each turn's tokens
  turn_grpo     returns-to-go normalised over each task's group of turns
  gae           GAE over turns with the policy's value head (needs values)
  branching     critic-free per-turn TD advantages with Monte-Carlo values
                V(s_t) from continuations sampled at each turn
                (`RolloutEngine.branch`, `branch_returns`)

Trajectory rewards are the episode returns; turn rewards are the per-step
rewards the environment reported (outcome, format, cost and process parts).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from agentrl_jax import advantages as adv
from agentrl_jax.train.step import decision_mask
from agentrl_jax.trajectory import TokenBatch, Trajectory, turn_arrays

CREDIT_SCHEMES = ("grpo", "drgrpo", "rloo", "turn_returns", "turn_grpo", "gae",
                  "branching")


def group_ids_of(trajs: Sequence[Trajectory]) -> np.ndarray:
  return np.asarray([t.metadata["group_id"] for t in trajs], np.int32)


def turn_values_from_tokens(token_values: np.ndarray, batch: TokenBatch,
                            num_trajs: int, num_turns: int
                            ) -> tuple[np.ndarray, np.ndarray]:
  """Reads V(s_t) at each turn's decision position, and V after the last turn.

  Returns (values [N, T], bootstrap [N]): the value head at the token before
  each turn's first action (in the context that action was sampled in), and
  at each trajectory's last token when that is not an action token: a
  truncated episode ends on the observation after its last action and the
  next assistant header (the state after its last turn; under a sliding
  window, read in the window the next action would have seen: the view with
  no trained tokens when the window moved, else the view holding its last
  turn), the same kind of position the value head is trained at. An episode
  that ends on an action has no next state (it terminated, or the next
  observation did not fit the context, so nothing could follow): bootstrap 0.
  """
  seq_ids, turn_index = batch.seq_ids, batch.turn_index
  on = np.asarray(decision_mask(jnp.asarray(turn_index))) & (seq_ids >= 0)
  values = np.zeros((num_trajs, num_turns), np.float32)
  rows, cols = np.nonzero(on)
  values[seq_ids[rows, cols], turn_index[rows, cols + 1]] = token_values[rows, cols]
  real = seq_ids >= 0
  same_as_prev = np.pad(real[:, 1:] & (seq_ids[:, 1:] == seq_ids[:, :-1]),
                        ((0, 0), (1, 0)))
  # Runs of one seq id in a row are sequences (views never share a row).
  run_id = np.cumsum(real & ~same_as_prev).reshape(seq_ids.shape) - 1
  run_turn = np.full(int(run_id.max(initial=-1)) + 1, -1)
  np.maximum.at(run_turn, run_id[real], turn_index[real])
  last = real & ~np.pad(same_as_prev[:, 1:], ((0, 0), (0, 1)))
  bootstrap = np.zeros(num_trajs, np.float32)
  best = np.full(num_trajs, -2)
  for r, c in zip(*np.nonzero(last)):
    i, turn = seq_ids[r, c], run_turn[run_id[r, c]]
    if turn < 0:  # the final state's own view (no trained tokens) wins
      turn = num_turns
    if turn > best[i]:
      best[i] = turn
      bootstrap[i] = token_values[r, c] if turn_index[r, c] < 0 else 0.0
  return values, bootstrap


def _return_to_go(traj: Trajectory, t: int, gamma: float) -> float:
  rewards, _ = turn_arrays([traj])
  return float(sum(gamma ** k * r for k, r in enumerate(rewards[0, t:])))


def branch_returns(trajs: Sequence[Trajectory],
                   branches: dict[tuple[int, int], Sequence[Trajectory]], *,
                   gamma: float = 1.0, num_turns: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Monte-Carlo samples of V(s_t) for `advantages.branching_advantages`.

  The samples of the state before trajectory i's turn t are its own return
  from t on, plus: at t = 0, the returns of the other members of its group
  (they all start from the task's initial state); at t >= 1, the returns
  from t of `branches[(i, t)]`, continuations sampled from that state.

  Returns (returns [N, T, K], mask [N, T, K]), K the most samples of a state.
  """
  turn_rewards, turn_mask = turn_arrays(trajs, num_turns)
  own = np.asarray(adv.discounted_returns(turn_rewards, turn_mask, gamma))
  groups = group_ids_of(trajs)
  samples: dict[tuple[int, int], list[float]] = {}
  for i, traj in enumerate(trajs):
    if traj.num_turns:
      samples[i, 0] = list(own[groups == groups[i], 0])
    for t in range(1, traj.num_turns):
      samples[i, t] = [own[i, t]] + [_return_to_go(c, t, gamma)
                                     for c in branches.get((i, t), ())]
  width = max([len(v) for v in samples.values()] + [1])
  returns = np.zeros((*own.shape, width), np.float32)
  mask = np.zeros((*own.shape, width), np.float32)
  for (i, t), values in samples.items():
    returns[i, t, :len(values)] = values
    mask[i, t, :len(values)] = 1.0
  return returns, mask


def assign(scheme: str, trajs: Sequence[Trajectory], batch: TokenBatch, *,
           gamma: float = 1.0, lam: float = 0.95, num_turns: int | None = None,
           token_values: np.ndarray | None = None,
           branch_values: tuple[np.ndarray, np.ndarray] | None = None) -> TokenBatch:
  """Fills `batch.advantages` (and `batch.returns` for "gae").

  Args:
    scheme: one of CREDIT_SCHEMES.
    trajs: the N trajectories `batch` was collated from (same order), with
      `metadata["group_id"]`.
    gamma, lam: turn discount and GAE lambda.
    num_turns: T of the [N, T] turn arrays (default: the longest episode).
    token_values: [B, L] value-head outputs on `batch` ("gae" only).
    branch_values: (returns [N, T, K], mask [N, T, K]) from `branch_returns`
      ("branching" only). The bootstrap after a truncated episode is 0: its
      continuations ran under the same turn budget, so their returns stop
      there too.
  """
  if scheme not in CREDIT_SCHEMES:
    raise ValueError(f"unknown credit scheme {scheme!r}; known: {CREDIT_SCHEMES}")
  groups = jnp.asarray(group_ids_of(trajs))
  seq_ids, turn_index = jnp.asarray(batch.seq_ids), jnp.asarray(batch.turn_index)
  if scheme in ("grpo", "drgrpo", "rloo"):
    rewards = jnp.asarray([t.reward for t in trajs], jnp.float32)
    if scheme == "rloo":
      a = adv.rloo_advantages(rewards, groups)
    else:
      a = adv.grpo_advantages(rewards, groups, scale="std" if scheme == "grpo" else "none")
    return batch.replace(advantages=np.asarray(
        adv.broadcast_trajectory_values(a, seq_ids, turn_index)))
  turn_rewards, turn_mask = turn_arrays(trajs, num_turns)
  if scheme in ("turn_returns", "turn_grpo"):
    per_turn = adv.discounted_returns(turn_rewards, turn_mask, gamma)
    if scheme == "turn_grpo":
      per_turn = adv.group_normalize_turns(per_turn, turn_mask, groups)
    return batch.replace(advantages=np.asarray(
        adv.paint_turn_values(per_turn, seq_ids, turn_index)))
  terminated = jnp.asarray([t.terminated for t in trajs])
  if scheme == "branching":
    if branch_values is None:
      raise ValueError("credit scheme 'branching' needs branch_values (branch_returns)")
    returns, mask = branch_values
    a = adv.branching_advantages(jnp.asarray(returns), jnp.asarray(mask), turn_rewards,
                                 turn_mask, terminated, jnp.zeros(len(trajs)),
                                 gamma=gamma)
    return batch.replace(advantages=np.asarray(
        adv.paint_turn_values(a, seq_ids, turn_index)))
  if token_values is None:
    raise ValueError("credit scheme 'gae' needs token_values from the value head")
  values, bootstrap = turn_values_from_tokens(token_values, batch, len(trajs),
                                              turn_rewards.shape[1])
  a, returns = adv.gae_over_turns(turn_rewards, values * turn_mask, turn_mask,
                                  terminated, gamma, lam, bootstrap)
  on = np.asarray(decision_mask(turn_index)) & (batch.seq_ids >= 0)
  next_turn = np.pad(batch.turn_index[:, 1:], ((0, 0), (0, 1)), constant_values=0)
  token_returns = np.where(on, np.asarray(returns)[np.maximum(batch.seq_ids, 0),
                                                   np.maximum(next_turn, 0)], 0.0)
  return batch.replace(advantages=np.asarray(adv.paint_turn_values(a, seq_ids, turn_index)),
                       returns=token_returns.astype(np.float32))
