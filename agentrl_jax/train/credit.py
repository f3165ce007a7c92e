"""Credit assignment by name: rollouts + collated batch -> per-token advantages.

The registry researchers swap in configs (`CREDIT_SCHEMES`):

  grpo          trajectory-level group-relative, population std (GRPO)
  drgrpo        the same without the std division (Dr.GRPO)
  rloo          leave-one-out baseline
  turn_returns  per-turn discounted return-to-go on each turn's tokens
  turn_grpo     returns-to-go normalised over each task's group of turns
  gae           GAE over turns with the policy's value head (needs values)

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

CREDIT_SCHEMES = ("grpo", "drgrpo", "rloo", "turn_returns", "turn_grpo", "gae")


def group_ids_of(trajs: Sequence[Trajectory]) -> np.ndarray:
  return np.asarray([t.metadata["group_id"] for t in trajs], np.int32)


def turn_values_from_tokens(token_values: np.ndarray, batch: TokenBatch,
                            num_trajs: int, num_turns: int
                            ) -> tuple[np.ndarray, np.ndarray]:
  """Reads V(s_t) at each turn's decision position, and V after the last turn.

  Returns (values [N, T], bootstrap [N]): the value head at the token before
  each turn's first action, and at each trajectory's last token (the state
  after its last turn, for truncated episodes).
  """
  on = np.asarray(decision_mask(jnp.asarray(batch.turn_index))) & (batch.seq_ids >= 0)
  values = np.zeros((num_trajs, num_turns), np.float32)
  rows, cols = np.nonzero(on)
  values[batch.seq_ids[rows, cols], batch.turn_index[rows, cols + 1]] = token_values[rows, cols]
  bootstrap = np.zeros(num_trajs, np.float32)
  real = batch.seq_ids >= 0
  last = real & ~np.pad(real[:, 1:] & (batch.seq_ids[:, 1:] == batch.seq_ids[:, :-1]),
                        ((0, 0), (0, 1)))
  rows, cols = np.nonzero(last)
  bootstrap[batch.seq_ids[rows, cols]] = token_values[rows, cols]
  return values, bootstrap


def assign(scheme: str, trajs: Sequence[Trajectory], batch: TokenBatch, *,
           gamma: float = 1.0, lam: float = 0.95, num_turns: int | None = None,
           token_values: np.ndarray | None = None) -> TokenBatch:
  """Fills `batch.advantages` (and `batch.returns` for "gae").

  Args:
    scheme: one of CREDIT_SCHEMES.
    trajs: the N trajectories `batch` was collated from (same order), with
      `metadata["group_id"]`.
    gamma, lam: turn discount and GAE lambda.
    num_turns: T of the [N, T] turn arrays (default: the longest episode).
    token_values: [B, L] value-head outputs on `batch` ("gae" only).
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
  if token_values is None:
    raise ValueError("credit scheme 'gae' needs token_values from the value head")
  values, bootstrap = turn_values_from_tokens(token_values, batch, len(trajs),
                                              turn_rewards.shape[1])
  terminated = jnp.asarray([t.terminated for t in trajs])
  a, returns = adv.gae_over_turns(turn_rewards, values * turn_mask, turn_mask,
                                  terminated, gamma, lam, bootstrap)
  on = np.asarray(decision_mask(turn_index)) & (batch.seq_ids >= 0)
  next_turn = np.pad(batch.turn_index[:, 1:], ((0, 0), (0, 1)), constant_values=0)
  token_returns = np.where(on, np.asarray(returns)[np.maximum(batch.seq_ids, 0),
                                                   np.maximum(next_turn, 0)], 0.0)
  return batch.replace(advantages=np.asarray(adv.paint_turn_values(a, seq_ids, turn_index)),
                       returns=token_returns.astype(np.float32))
