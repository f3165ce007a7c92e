"""The RL loop: rollouts -> credit assignment -> batch -> jitted step -> sync.

One `RLTrainer.iteration(tasks, it)`:

  1. G rollouts per task through the RolloutEngine (policy version = it);
     episodes that an environment fault ended ("env_error", "env_timeout")
     are left out of training (their return is not the policy's doing) and
     counted in `rollout/ended/<reason>`;
  2. collate into a fixed [tasks x G, bucket] batch (static shapes; a
     sliding-window context policy adds a row per extra view, rounded up to
     a multiple of tasks x G so the step sees few shapes);
  3. credit assignment by name (`credit.assign`), with a value-head forward
     for "gae", and for "branching" `branch_size` continuations sampled from
     the state before every turn t >= 1 of every trajectory (a rollout cost
     of about branch_size x mean turns extra episodes per trajectory; the
     continuations only estimate values and are not trained on);
  4. optional filtering (`filter_zero_variance`): the rows of groups whose
     advantages are all exactly 0 are dropped (they only cost compute),
     logged as `rollout/kept_frac` and `rollout/dropped_groups`;
  5. the jitted train step, then weight sync into the sampler.

With several processes (`agentrl_jax.distributed`) each one rolls out its
share of the tasks on its own sampler and environments, collates and assigns
credit to its own trajectories (whole groups, so group baselines stay
local), and contributes its rows to the global batch of the step; the
processes first agree on the row count and bucket length, so every one
contributes the same static shape. Rollout metrics are combined over the
processes, so every process returns the same dict.

Non-finite updates are skipped by the step; `max_bad_steps` in a row raise.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from agentrl_jax import distributed, env_calls, losses, sharding
from agentrl_jax.envs.base import Task
from agentrl_jax.rollout import STOP_REASONS, RolloutEngine
from agentrl_jax.train import credit
from agentrl_jax.train.state import TrainState
from agentrl_jax.train import step as step_lib
from agentrl_jax.train.step import RLStep
from agentrl_jax.trajectory import TokenBatch, Trajectory, bucket_length, collate

# Rollout metrics that add up over processes, and those whose maximum counts.
_SUMS = ("rollout/episodes", "rollout/env_steps", "rollout/branch_episodes",
         "rollout/dropped_groups", "rollout/carried_episodes", "train/batch_tokens",
         *(f"rollout/ended/{r}" for r in STOP_REASONS))
_MAXIMA = ("rollout/turns_max", "rollout/staleness_max", "rollout/env_wait_s",
           "rollout/generation_s", "rollout/env_call_max_s",
           "rollout/env_calls_abandoned")
_ENV_FAULTS = (env_calls.ENV_ERROR, env_calls.ENV_TIMEOUT)


@dataclasses.dataclass(frozen=True)
class RLConfig:
  group_size: int = 8
  tasks_per_iteration: int = 8
  credit: str = "grpo"
  gamma: float = 1.0
  lam: float = 0.95
  filter_zero_variance: bool = False
  branch_size: int = 2  # continuations per intermediate state ("branching")
  # Partial rollouts: stop generating once an iteration sampled this many
  # tokens; unfinished episodes continue in the next iteration (re-prefilled
  # under the new weights; `staleness` per trajectory). None: every episode
  # finishes in its iteration. Carried episodes are not checkpointed: a
  # resumed run starts without them.
  token_budget: int | None = None
  buckets: tuple[int, ...] = (256, 512, 1024, 2048)
  max_bad_steps: int = 5


def curriculum_pool(tasks: Sequence[Task], schedule: Sequence[tuple[int, Sequence[int]]],
                    iteration: int) -> list[Task]:
  """The tasks whose level the curriculum allows at `iteration`.

  schedule: (first iteration, allowed levels) pairs, e.g. ((0, (0,)), (20,
  (0, 1))): 1-hop questions first, 2-hop ones mixed in from iteration 20.
  An empty schedule allows everything.
  """
  allowed = None
  for start, levels in sorted(schedule, key=lambda e: e[0]):
    if iteration >= start:
      allowed = set(levels)
  pool = [t for t in tasks if allowed is None or t.level in allowed]
  if not pool:
    raise ValueError(f"the curriculum allows levels {sorted(allowed)} at iteration "
                     f"{iteration}, but no task has them")
  return pool


def evaluate(engine: RolloutEngine, tasks: Sequence[Task], *,
             temperature: float = 0.0, samples: int = 1,
             seed: int | None = None) -> dict[str, float]:
  """Held-out success and reward over `samples` episodes per task.

  Greedy (temperature 0, one episode per task) by default; with sampling,
  pass a `seed` so the evaluation is reproducible. With several processes
  each runs its share of `tasks` and every one returns the overall result.
  """
  result = engine.run(distributed.task_share(tasks), samples, temperature=temperature,
                      seed=seed, isolated=True)
  m = result.metrics
  return distributed.combine(
      {"success": m["success_frac"], "reward": m["reward_mean"],
       "turns": m["turns_mean"], "truncated": m["truncated_frac"]}, m["episodes"])


class RLTrainer:
  """Owns the train state; the engine's sampler follows its parameters."""

  def __init__(self, engine: RolloutEngine, step: RLStep, state: TrainState,
               cfg: RLConfig, *, seed: int = 0):
    self.engine, self.step, self.state, self.cfg = engine, step, state, cfg
    self.seed = seed
    self.bad_in_a_row = 0
    if cfg.tasks_per_iteration % jax.process_count():
      raise ValueError(f"tasks_per_iteration={cfg.tasks_per_iteration} must divide by "
                       f"the {jax.process_count()} processes")
    self._credit = credit.scheme(cfg.credit)
    if cfg.token_budget is not None and self._credit.needs_branches:
      raise ValueError(f"credit scheme {cfg.credit!r} replays finished episodes of this "
                       "iteration's tasks; it cannot run with partial rollouts "
                       "(token_budget)")
    self._rows = None if step.mesh is None else sharding.batch_sharding(step.mesh)
    if self._credit.needs_values:
      # Values come back row-sharded: each process reads its own rows.
      self._values = jax.jit(self._values_impl, out_shardings=self._rows)

  def _values_impl(self, params, batch):
    return step_lib.token_values(self.step.graphdef, params, batch)

  def iteration(self, tasks: Sequence[Task], it: int) -> dict[str, float]:
    cfg = self.cfg
    # Each process samples its own stream (the same one with one process).
    seed = self.seed * 1_000_003 + it + 7919 * jax.process_index()
    result = self.engine.run(distributed.task_share(tasks), cfg.group_size,
                             policy_version=it, seed=seed % 2**31,
                             token_budget=cfg.token_budget)
    trajs = [t for t in result.trajectories
             if t.metadata["stop_reason"] not in _ENV_FAULTS]
    metrics = {f"rollout/{k}": v for k, v in result.metrics.items()}
    metrics["rollout/env_steps"] = float(sum(t.num_turns for t in trajs))
    if cfg.token_budget is not None:
      metrics["rollout/carried_episodes"] = float(self.engine.carried)
    # Static shapes, the same on every process: rows for the most views any
    # process holds (a multiple of its share of tasks x G, so the step sees
    # few shapes), the bucket of the longest sequence of any process.
    base = cfg.tasks_per_iteration * cfg.group_size // jax.process_count()
    flats = [f for t in trajs for f in t.flatten_views()]  # one per row
    any_rolled, views, longest, most_actions = distributed.agree_max([
        len(trajs) > 0, sum(t.num_views for t in trajs),
        max((len(f.ids) for f in flats), default=0),
        max((int(f.loss_mask.sum()) for f in flats), default=0)])
    if not any_rolled:  # partial rollouts: no group completed anywhere yet
      return self._skip(metrics, len(trajs))
    num_rows, length = base * -(-int(views) // base), bucket_length(int(longest), cfg.buckets)
    batch = (collate(trajs, buckets=(length,), num_rows=num_rows) if trajs
             else _padding_batch(num_rows, length))
    to_global = lambda b: distributed.global_batch(b, self._rows)
    values = (distributed.local_rows(self._values(self.state.params, to_global(batch)))
              if self._credit.needs_values else None)
    branch_values = None
    if self._credit.needs_branches:
      episodes, steps = 0.0, 0.0
      if trajs:
        branch_values, episodes, steps = branch_values_of(
            self.engine, tasks, trajs, cfg.branch_size, gamma=cfg.gamma,
            policy_version=it, seed=(self.seed * 1_000_003 + it + 500_009) % 2**31)
      metrics["rollout/branch_episodes"] = episodes
      metrics["rollout/env_steps"] += steps
    if trajs:
      batch = credit.assign(cfg.credit, trajs, batch, gamma=cfg.gamma, lam=cfg.lam,
                            num_turns=self.engine.config.max_turns, token_values=values,
                            branch_values=branch_values)
    if cfg.filter_zero_variance:
      batch, kept, dropped = _drop_groups_without_signal(batch, trajs)
      metrics["rollout/kept_frac"] = kept / max(len(trajs), 1)
      metrics["rollout/dropped_groups"] = float(dropped)
      rows, = distributed.agree_max([int(np.sum(batch.seq_ids.max(axis=1) >= 0))])
      if rows == 0:  # no group carries any signal: nothing to learn from this batch
        return self._skip(metrics, len(trajs))
      batch = _pad_rows(batch, base * -(-int(rows) // base))
    metrics["train/batch_tokens"] = float(batch.loss_mask.sum())
    metrics = self._combine(metrics, len(result.trajectories))
    num_actions = losses.action_bucket(int(most_actions), length)
    self.state, train_metrics = self.step(self.state, to_global(batch), num_actions)
    train_metrics = jax.device_get(train_metrics)
    self.engine.sampler.update_params(self.state.params)
    skipped = float(train_metrics["skipped_updates"]) > 0
    self.bad_in_a_row = self.bad_in_a_row + 1 if skipped else 0
    if self.bad_in_a_row >= cfg.max_bad_steps:
      raise FloatingPointError(
          f"{self.bad_in_a_row} train steps in a row had a non-finite loss or "
          "gradient; stopping (lower the learning rate or check the rewards)")
    metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
    return metrics

  def _skip(self, metrics: dict[str, float], episodes: int) -> dict[str, float]:
    metrics = self._combine(metrics, episodes)
    metrics["train/skipped_batch"] = 1.0
    return metrics

  @staticmethod
  def _combine(metrics: dict[str, float], episodes: int) -> dict[str, float]:
    """This process's rollout metrics -> those over every process."""
    return distributed.combine(metrics, episodes, sums=_SUMS, maxima=_MAXIMA)

def branch_values_of(engine: RolloutEngine, tasks: Sequence[Task],
                     trajs: Sequence[Trajectory], branch_size: int, *, gamma: float,
                     policy_version: int = 0, seed: int | None = None):
  """Continuations from every intermediate state -> `credit.branch_returns`.

  Samples `branch_size` continuations before every turn t >= 1 of every
  trajectory (the tasks they came from must be in `tasks`). Returns
  (branch_values, continuations run, env steps they sampled, replayed turns
  aside).
  """
  task_of = {t.task_id: t for t in tasks}
  points = [(i, t) for i, traj in enumerate(trajs) for t in range(1, traj.num_turns)]
  continuations = engine.branch(
      [(task_of[trajs[i].metadata["task_id"]], trajs[i], t) for i, t in points],
      branch_size, policy_version=policy_version, seed=seed) if points else []
  # A continuation an env fault ended estimates nothing: left out.
  continuations = [[c for c in conts if c.metadata["stop_reason"] not in _ENV_FAULTS]
                   for conts in continuations]
  values = credit.branch_returns(trajs, dict(zip(points, continuations)), gamma=gamma,
                                 num_turns=engine.config.max_turns)
  steps = sum(c.num_turns - t for (_, t), conts in zip(points, continuations)
              for c in conts)
  return values, float(len(points) * branch_size), float(steps)


def _padding_batch(num_rows: int, length: int) -> TokenBatch:
  """[num_rows, length] of padding only: a process whose groups were all
  filtered out still contributes its rows to the global batch."""
  zeros = lambda dtype: np.zeros((num_rows, length), dtype)
  empty = np.full((num_rows, length), -1, np.int32)
  return TokenBatch(tokens=zeros(np.int32), loss_mask=zeros(np.float32),
                    old_logprobs=zeros(np.float32), advantages=zeros(np.float32),
                    turn_index=empty, seq_ids=empty.copy(), positions=zeros(np.int32),
                    returns=zeros(np.float32))


def _drop_groups_without_signal(batch: TokenBatch, trajs: Sequence[Trajectory]
                                ) -> tuple[TokenBatch, int, int]:
  """Removes the rows of every group whose advantages are all exactly 0.

  Such a group adds nothing to the policy gradient (its surrogate's
  gradient is A x ratio-gradient = 0) but costs a forward and a backward.
  The test is on the assigned advantages, not on the rewards: equal rewards
  still carry per-turn signal under turn-level credit. Returns the kept rows
  (compacted, the same width), how many trajectories they hold and how many
  groups were dropped.
  """
  groups = np.asarray([t.metadata["group_id"] for t in trajs])
  ids = batch.seq_ids
  signal = np.zeros(len(trajs), bool)
  np.logical_or.at(signal, ids[ids >= 0], batch.advantages[ids >= 0] != 0)
  informative = {g for g, s in zip(groups, signal) if s}
  keep_traj = np.asarray([g in informative for g in groups])
  row_owner = ids.max(axis=1)
  keep = (row_owner >= 0) & keep_traj[np.maximum(row_owner, 0)]
  return (jax.tree.map(lambda x: x[keep], batch), int(keep_traj.sum()),
          len(set(groups.tolist()) - informative))


def _pad_rows(batch: TokenBatch, num_rows: int) -> TokenBatch:
  """Appends padding rows up to `num_rows`."""
  pad = _padding_batch(num_rows - batch.tokens.shape[0], batch.tokens.shape[1])
  return jax.tree.map(lambda a, b: np.concatenate([a, b]), batch, pad)
