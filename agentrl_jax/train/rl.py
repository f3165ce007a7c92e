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
     of about branch_size x mean turns extra episodes per trajectory, each
     forking its episode's cached prefix: `RolloutEngine.branch`; the
     continuations only estimate values and are not trained on);
  4. optional filtering (`filter_zero_variance`): the rows of groups whose
     advantages are all exactly 0 are dropped (they only cost compute;
     advantages of the episodes before overlong shaping: DAPO filters on
     the outcome), logged as `rollout/kept_frac` and `rollout/dropped_groups`; with
     `max_refill_tasks`, DAPO's dynamic sampling: more tasks are rolled out
     (through steps 1-4) until tasks_per_iteration groups carry signal or
     the cap is spent (`rollout/refill_tasks`), so every update holds the
     same number of informative groups (never more);
  5. the jitted train step, then weight sync into the sampler; with
     `max_staleness` s > 0 the rollouts run ahead on a worker thread
     instead, iteration i's with iteration i - s's weights (`pipeline`).

DAPO's overlong shaping, both off by default: `overlong_buffer` subtracts a
penalty growing linearly from 0 to `overlong_penalty` over the last
`overlong_buffer` tokens of the context budget (on the episode's last turn,
before credit assignment; branching's continuations alike), and
`mask_truncated` zeroes the loss of every truncated episode (a budget of
turns, tokens or time ran out), which still counts in its group's baseline
(and in the seq-mean aggregations' |S|).

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
import functools
import math
import time
import warnings
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from agentrl_jax import distributed, env_calls, losses, sharding
from agentrl_jax.checks import check_fields
from agentrl_jax.envs.base import Task
from agentrl_jax.rollout import STOP_REASONS, RolloutConfig, RolloutEngine, RolloutResult
from agentrl_jax.train import credit, pipeline
from agentrl_jax.train.state import TrainState
from agentrl_jax.train import step as step_lib
from agentrl_jax.train.step import RLStep
from agentrl_jax.trajectory import (TokenBatch, Trajectory, bucket_length, collate,
                                    pack_batch)

# Rollout metrics that add up over processes, and those whose maximum counts.
_SUMS = ("rollout/episodes", "rollout/env_steps", "rollout/branch_episodes",
         "rollout/sampler_fed_tokens", "rollout/branch_forked", "rollout/branch_fed_tokens",
         "rollout/branch_generated_tokens", "rollout/dropped_groups",
         "rollout/carried_episodes", "train/batch_tokens", "train/shared_tokens",
         *(f"rollout/ended/{r}" for r in STOP_REASONS))
_MAXIMA = ("rollout/turns_max", "rollout/staleness_max", "rollout/env_wait_s",
           "rollout/generation_s", "rollout/branch_generation_s", "rollout/env_call_max_s",
           "rollout/env_calls_abandoned")
_ENV_FAULTS = (env_calls.ENV_ERROR, env_calls.ENV_TIMEOUT)


@dataclasses.dataclass(frozen=True)
class RLConfig:
  group_size: int = 8
  tasks_per_iteration: int = 8
  credit: str = "grpo"
  gamma: float = 1.0
  lam: float = 0.95
  # Whiten the advantages over the batch's action tokens, (A - mean) /
  # sqrt(var + 1e-8) (veRL's GAE default; `credit.assign(whiten=...)`); the
  # value targets are not whitened.
  whiten_advantages: bool = False
  filter_zero_variance: bool = False
  branch_size: int = 2  # continuations per intermediate state ("branching")
  # Continuations fork their episode's cached prefix (a device snapshot of
  # one attention window per episode until the branches are taken); False:
  # each re-prefills it (no snapshot memory).
  fork_branches: bool = True
  # Partial rollouts: stop generating once an iteration sampled this many
  # tokens; unfinished episodes continue in the next iteration (re-prefilled
  # under the new weights; `staleness` per trajectory). None: every episode
  # finishes in its iteration. Carried episodes are not checkpointed: a
  # resumed run starts without them.
  token_budget: int | None = None
  buckets: tuple[int, ...] = (256, 512, 1024, 2048)
  max_bad_steps: int = 5
  # DAPO dynamic sampling (needs filter_zero_variance): extra tasks rolled
  # out at most per iteration to refill the filtered groups; 0: no refill.
  max_refill_tasks: int = 0
  # DAPO overlong shaping: the soft penalty's span in tokens (0: off) and size.
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0
  mask_truncated: bool = False
  # The observation-masking ablation (Search-R1's "without masking"): the
  # policy loss also covers every environment-written token after an
  # episode's first action (`observation_credit`). False: actions only.
  observation_loss: bool = False
  # Asynchronous RL (`pipeline`): iteration i's rollouts sample with the
  # weights of iteration i - max_staleness, on a worker thread, while the
  # trainer updates on the iterations before. 0: synchronous.
  max_staleness: int = 0
  # RAGEN's rollout filter (StarPO-S, against the "echo trap"): train on
  # this fraction of the iteration's groups (rounded up), those whose
  # outcome rewards spread most (`_keep_most_varied_groups`). 1.0: all.
  top_variance_frac: float = 1.0
  # Sequence packing (`trajectory.pack_batch`): after credit and filtering,
  # the episodes share rows of the bucket's length, so the step computes
  # far less padding; the row count rounds up to a multiple of
  # pack_row_multiple (few step shapes), and a batch packing would not make
  # smaller stays as it is. The loss and gradient are the unpacked ones.
  pack: bool = False
  pack_row_multiple: int = 8
  # Tree rows (`pack_batch(share_prompts=True)`, with pack): episodes that
  # begin alike (a group's prompt, every task's system turn) hold those
  # tokens once, in rows of the largest bucket; the same loss and gradient.
  share_prompts: bool = False

  def __post_init__(self):
    check_fields(self, [
        ("group_size", self.group_size >= 1, "must be >= 1"),
        ("tasks_per_iteration", self.tasks_per_iteration >= 1, "must be >= 1"),
        ("credit", self.credit in credit.schemes(),
         f"must be one of {credit.schemes()} (or a scheme registered with "
         "credit.register before the config is read)"),
        ("buckets", len(self.buckets) > 0 and min(self.buckets) >= 1,
         "must be positive lengths"),
        ("max_refill_tasks", self.max_refill_tasks >= 0, "must be >= 0"),
        ("overlong_buffer", self.overlong_buffer >= 0, "must be >= 0"),
        ("max_staleness", self.max_staleness >= 0, "must be >= 0"),
        ("top_variance_frac", 0 < self.top_variance_frac <= 1, "must be in (0, 1]"),
        ("pack_row_multiple", self.pack_row_multiple >= 1, "must be >= 1"),
        ("share_prompts", self.pack or not self.share_prompts,
         "shares prompts as it packs rows: set pack=True too"),
    ])
    if self.max_refill_tasks and self.top_variance_frac < 1:
      raise ValueError("max_refill_tasks refills groups to a count that top_variance_frac "
                       "< 1 would cut again; use one of the two")
    if self.whiten_advantages and self.filter_zero_variance:
      raise ValueError("whiten_advantages cannot run with filter_zero_variance: the filter "
                       "drops groups whose advantages are exactly 0, which whitening moves "
                       "off 0")
    if self.max_refill_tasks and not self.filter_zero_variance:
      raise ValueError("max_refill_tasks refills the groups filter_zero_variance drops; "
                       "turn filtering on")
    if self.max_refill_tasks and self.token_budget is not None:
      raise ValueError("max_refill_tasks cannot run with partial rollouts (token_budget)")
    if self.max_staleness and self.token_budget is not None:
      raise ValueError("max_staleness cannot run with partial rollouts (token_budget): an "
                       "episode carried into a later rollout would train more than "
                       "max_staleness versions after its first token")
    if self.max_staleness and self.max_refill_tasks:
      raise ValueError("max_staleness cannot run with dynamic sampling (max_refill_tasks): "
                       "refills roll out inside the update")
    branches = credit.scheme(self.credit).needs_branches
    if branches and self.token_budget is not None:
      raise ValueError(f"credit scheme {self.credit!r} replays finished episodes of this "
                       "iteration's tasks; it cannot run with partial rollouts "
                       "(token_budget)")
    if branches and self.max_staleness:
      raise ValueError(f"credit scheme {self.credit!r} rolls out continuations inside "
                       "the update; it cannot run with max_staleness > 0")


def check_sections(cfg: RLConfig, loss: step_lib.LossConfig, max_context: int,
                   rollout: RolloutConfig | None = None) -> None:
  """Raises ValueError if `cfg` cannot run with the loss section, a
  context budget of `max_context` tokens (the sampler's cache length) and
  the `rollout` section (None: not checked). RLConfig checks its own
  fields; this is every rule that spans sections, in one place:
  `RLTrainer` calls it, and so does a config's validation before any work."""
  if max(cfg.buckets) < max_context:
    raise ValueError(f"buckets={cfg.buckets} must hold a full episode: the largest "
                     f"entry >= the context budget ({max_context} tokens)")
  if rollout is not None and loss.is_correction != "tis":
    _check_sampling(rollout, loss)
  if cfg.overlong_buffer >= max_context:
    raise ValueError(f"overlong_buffer={cfg.overlong_buffer} must be below the context "
                     f"budget ({max_context} tokens)")
  if cfg.pack and cfg.pack_row_multiple % loss.micro_batches:
    raise ValueError(f"pack_row_multiple={cfg.pack_row_multiple} must divide by "
                     f"loss.micro_batches={loss.micro_batches}: packed rows split into them")
  if cfg.max_staleness and loss.is_correction != "tis":
    raise ValueError(
        "max_staleness > 0 trains on rollouts of older weights: set "
        "loss.is_correction='tis', so the ratio is taken against the trainer's own "
        "log-probs and the sampler's are importance-weighted (see pipeline.py)")


def _check_sampling(rollout: RolloutConfig, loss: step_lib.LossConfig) -> None:
  """Without importance weights the ratio's old log-probs must be those of
  the distribution the tokens were drawn from: the trained policy itself."""
  fix = ("or set loss.is_correction='tis' (importance weights from the "
         "sampled distribution to the trained policy)")
  if rollout.temperature != loss.temperature:
    raise ValueError(
        f"rollout.temperature={rollout.temperature} samples another distribution than "
        f"the policy the loss trains (loss.temperature={loss.temperature}): set "
        f"loss.temperature={rollout.temperature} to train the distribution sampled "
        f"from, {fix}")
  if rollout.top_k or rollout.top_p < 1.0:
    raise ValueError(
        f"rollout.top_k={rollout.top_k}, rollout.top_p={rollout.top_p} sample a "
        f"filtered distribution, the loss trains the unfiltered policy "
        f"(loss.temperature={loss.temperature}): turn the filter off (top_k=0, "
        f"top_p=1.0), {fix}")


@dataclasses.dataclass(frozen=True)
class Recorded:
  """An iteration's episodes as trained: the credited batch (before
  filtering) and the trainer's log-probs [B, L] before the update."""

  trajectories: list[Trajectory]
  batch: TokenBatch
  trainer_logprobs: np.ndarray


def observation_credit(batch: TokenBatch) -> tuple[TokenBatch, np.ndarray]:
  """`batch` with its observation tokens in the policy loss (the ablation
  `RLConfig.observation_loss`): every non-action token of an episode after
  its first action (environment output and the chat template's turn
  markers) joins the loss mask with the advantage of the action token
  before it, the turn whose action it answers. The prompt before the first
  action stays out, as it does for SFT. Returns the batch and the [B, L]
  bool mask of the tokens added; their old log-probs are left for the
  caller (the sampler never sampled them).
  """
  real = batch.seq_ids >= 0
  action = (batch.loss_mask > 0) & real
  rows = np.arange(action.shape[0])[:, None]
  # The position of the latest action token at or before each token.
  last = np.maximum.accumulate(
      np.where(action, np.arange(action.shape[1])[None, :], -1), axis=1)
  before = np.maximum(last, 0)
  added = real & ~action & (last >= 0) & (batch.seq_ids[rows, before] == batch.seq_ids)
  return batch.replace(
      loss_mask=np.where(added, 1.0, batch.loss_mask).astype(np.float32),
      advantages=np.where(added, batch.advantages[rows, before],
                          batch.advantages).astype(np.float32)), added


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


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k of one task from n samples, c of them successes:
  1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating large language
  models trained on code", eq. 1), the probability that k of the n samples
  drawn without replacement hold a success; computed as a product, so no
  binomial overflows. pass@1 = c / n; with k = n it is 1 if c > 0 else 0.
  """
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def paired_gain(before: Mapping[str, float], after: Mapping[str, float]
                ) -> tuple[float, float]:
  """The mean change after - before over the tasks both score (a held-out
  set evaluated twice, e.g. after SFT and after RL) and its standard error
  from the per-task differences: std(d, ddof=1) / sqrt(n), two-pass in
  float64. Pairing on tasks leaves out the between-task spread that the
  standard error of two independent proportions counts (only the tasks
  whose outcome changed add to it). NaN SE with fewer than 2 tasks."""
  common = sorted(before.keys() & after.keys())
  if not common:
    raise ValueError("the two evaluations share no task")
  d = np.asarray([after[k] - before[k] for k in common], np.float64)
  mean = d.mean()
  if len(d) < 2:
    return float(mean), float("nan")
  return float(mean), float(np.sqrt(np.sum((d - mean) ** 2) / (len(d) - 1) / len(d)))


def evaluate(engine: RolloutEngine, tasks: Sequence[Task], *,
             temperature: float = 0.0, samples: int = 1, seed: int | None = None,
             trajectories: list | None = None, policy_version: int = 0
             ) -> dict[str, float]:
  """Held-out metrics over `samples` episodes per task.

  "success" is the mean over every episode (avg@k with k = samples),
  "reward", "turns" and "truncated" likewise; with samples > 1 also
  f"pass_at_{samples}", the mean over tasks of `pass_at_k` (a task with
  fewer recorded episodes, some having ended on an environment fault, gets
  pass@n of the n it has).
  Greedy (temperature 0, one episode per task) by default; with sampling,
  pass a `seed` so the evaluation is reproducible. With several processes
  each runs its share of `tasks` and every one returns the overall result.
  trajectories: a list this process's episodes are appended to.
  policy_version: the version of the sampler's weights, recorded on the episodes.
  """
  result = engine.run(distributed.task_share(tasks), samples, temperature=temperature,
                      seed=seed, isolated=True, policy_version=policy_version)
  if trajectories is not None:
    trajectories.extend(result.trajectories)
  m = result.metrics
  out = distributed.combine(
      {"success": m["success_frac"], "reward": m["reward_mean"],
       "turns": m["turns_mean"], "truncated": m["truncated_frac"]}, m["episodes"])
  if samples > 1:
    outcomes = {}
    for t in result.trajectories:
      outcomes.setdefault(t.metadata["task_id"], []).append(bool(t.metadata["success"]))
    per_task = [pass_at_k(len(o), sum(o), min(samples, len(o))) for o in outcomes.values()]
    key = f"pass_at_{samples}"
    out.update(distributed.combine({key: float(np.mean(per_task)) if per_task else 0.0},
                                   len(per_task)))
  return out


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
    self._keep_caches = self._credit.needs_branches and cfg.fork_branches
    if cfg.max_refill_tasks and jax.process_count() > 1:
      raise ValueError("max_refill_tasks (dynamic sampling) runs in one process only: the "
                       "processes would have to agree on every refill round")
    # Duck-typed engines may not say: they sample the trained policy.
    sampling = RolloutConfig(
        temperature=getattr(engine.config, "temperature", step.cfg.temperature),
        top_k=getattr(engine.config, "top_k", 0), top_p=getattr(engine.config, "top_p", 1.0))
    check_sections(cfg, step.cfg, engine.max_context, sampling)
    # A sampler that does not say reports the temperature-1 policy's.
    reported = getattr(engine.sampler, "policy_temperature", 1.0)
    if reported != step.cfg.temperature:
      # Else every ratio starts away from 1 by the two temperatures' gap.
      raise ValueError(
          f"the sampler reports log-probs at policy_temperature="
          f"{reported}, the loss trains the policy at "
          f"temperature={step.cfg.temperature}: build the Sampler with "
          f"policy_temperature={step.cfg.temperature}")
    if sampling.top_k or sampling.top_p < 1.0:
      # (Without "tis" check_sections refused it.) Importance weights cannot
      # reach what is never sampled.
      warnings.warn(
          f"rollout top_k={sampling.top_k}, top_p={sampling.top_p}: the sampler draws "
          "from the filtered distribution but the loss trains the unfiltered policy, so "
          "the tokens the filter drops never get a gradient and their mass can grow "
          "unseen; watch train/policy_entropy (the trained policy's), not the rollouts",
          RuntimeWarning, stacklevel=2)
    if cfg.max_staleness and jax.process_count() > 1:
      raise ValueError("max_staleness > 0 runs in one process only")
    self._worker = pipeline.RolloutWorker() if cfg.max_staleness else None
    self._ahead: dict[int, list[str]] = {}  # the task ids of the rollouts started ahead
    self._rows = None if step.mesh is None else sharding.batch_sharding(step.mesh)
    if self._credit.needs_values:
      # Values come back row-sharded: each process reads its own rows.
      self._values = jax.jit(self._values_impl, out_shardings=self._rows)
    self._logprobs = jax.jit(self._logprobs_impl, static_argnums=(2,),
                             out_shardings=self._rows)
    self.recorded: Recorded | None = None

  def _values_impl(self, params, batch):
    return step_lib.token_values(self.step.graphdef, params, batch)

  def _logprobs_impl(self, params, batch, num_actions):
    return step_lib.action_logprobs(self.step.graphdef, params, batch, num_actions,
                                    chunk=self.step.cfg.head_chunk,
                                    temperature=self.step.cfg.temperature)

  def iteration(self, tasks: Sequence[Task], it: int,
                refill: Callable[[int], Sequence[Task]] | None = None,
                record: bool = False,
                upcoming: Callable[[int], Sequence[Task] | None] | None = None
                ) -> dict[str, float]:
    """One iteration on `tasks` (policy version `it`); returns its metrics.

    refill: n -> up to n more tasks (none of `tasks`), for DAPO's dynamic
      sampling (`max_refill_tasks`); None: no refill.
    record: keep this iteration's episodes, their credited batch and the
      trainer's log-probs before the update in `self.recorded` (for the
      trajectory viewer).
    upcoming: with `max_staleness` s > 0, j -> the tasks of iteration j (None
      past the run's last), for the rollouts started ahead: iterations it + 1
      .. it + s not yet in flight start now with the current weights.
    """
    if not self.cfg.max_staleness:
      return self._learn(self._rollout(tasks, it, it), tasks, it, refill, record)
    if upcoming is None:
      raise ValueError("max_staleness > 0 rolls out ahead: pass `upcoming`")
    weights = None  # the current weights, copied once for every job started now
    for j in range(it, it + self.cfg.max_staleness + 1):
      ahead = tasks if j == it else upcoming(j)
      if j in self._worker or ahead is None:
        continue
      if weights is None:
        weights = self.engine.sampler.prepare_params(self.state.model_params)
      self._worker.submit(j, functools.partial(self._rollout, ahead, j, it, weights))
      self._ahead[j] = [t.task_id for t in ahead]
    if self._ahead.pop(it) != [t.task_id for t in tasks]:
      raise ValueError(f"iteration {it}'s rollouts started ahead on other tasks than "
                       "it was given: `upcoming` must return each iteration's tasks")
    t0 = time.perf_counter()
    rolled = self._worker.take(it)
    waited = time.perf_counter() - t0
    metrics = self._learn(rolled, tasks, it, refill, record)
    metrics["time/rollout_wait_s"] = waited  # what the overlap did not hide
    return metrics

  def settle(self) -> None:
    """Waits for the rollouts in flight and gives the sampler the current
    weights (before an evaluation); with max_staleness 0 there are none."""
    if self._worker is not None:
      self._worker.settle()
      self.engine.sampler.update_params(self.state.model_params)

  def close(self) -> None:
    """Stops the rollout worker (its rollouts in flight finish first)."""
    if self._worker is not None:
      self._worker.close()

  def _rollout(self, tasks: Sequence[Task], it: int, version: int, weights=None
               ) -> tuple[RolloutResult, int]:
    """Iteration `it`'s rollouts of `tasks`, sampled by policy `version` (with
    `weights`, installed first; None: the sampler's current ones)."""
    if weights is not None:
      self.engine.sampler.params = weights
    # Each process samples its own stream (the same one with one process).
    seed = self.seed * 1_000_003 + it + 7919 * jax.process_index()
    return self.engine.run(distributed.task_share(tasks), self.cfg.group_size,
                           policy_version=version, seed=seed % 2**31,
                           token_budget=self.cfg.token_budget,
                           keep_caches=self._keep_caches), version

  def _learn(self, rolled: tuple[RolloutResult, int], tasks: Sequence[Task], it: int,
             refill, record: bool) -> dict[str, float]:
    """Credit, batch, step and weight sync on iteration `it`'s rollouts."""
    cfg = self.cfg
    result, version = rolled
    metrics = {f"rollout/{k}": v for k, v in result.metrics.items()}
    if version != it:  # sampled ahead: staleness counts to the update it feeds
      # (An episode without an action has no version: nothing of it trains.)
      stale = [it - min(t.metadata["policy_versions"], default=it)
               for t in result.trajectories] or [0]
      for t, st in zip(result.trajectories, stale):
        t.metadata["staleness"] = st
      metrics.update({"rollout/staleness_mean": float(np.mean(stale)),
                      "rollout/staleness_max": float(np.max(stale))})
    outcomes, trajs = self._trainable(result.trajectories, metrics)
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
    batch, outcome_advantages = self._assign(batch, outcomes, trajs, tasks, it, metrics)
    if cfg.observation_loss:  # the observation tokens joined the loss
      most_actions = max(int(most_actions), self._most_in_loss(batch))
    if record:
      num = losses.action_bucket(int(most_actions), length)
      self.recorded = Recorded(trajs, batch, distributed.local_rows(self._logprobs(
          self.state.model_params, self._to_global(batch), num)))
    if cfg.filter_zero_variance:
      batch, kept, groups, dropped = _keep_groups_with_signal(batch, trajs,
                                                              outcome_advantages)
      metrics["rollout/kept_frac"] = kept / max(len(trajs), 1)
      metrics["rollout/dropped_groups"] = float(dropped)
      if cfg.max_refill_tasks and refill is not None:
        batch = self._refill(batch, groups, len(trajs), it, refill, metrics)
        length = batch.tokens.shape[1]
        most_actions = max(int(most_actions), int(batch.loss_mask.sum(axis=1).max(initial=0)))
      rows, = distributed.agree_max([int(np.sum(batch.seq_ids.max(axis=1) >= 0))])
      if rows == 0:  # no group carries any signal: nothing to learn from this batch
        return self._skip(metrics, len(trajs))
      batch = _pad_rows(batch, base * -(-int(rows) // base))
    if cfg.top_variance_frac < 1:
      batch, kept = _keep_most_varied_groups(batch, outcomes, cfg.top_variance_frac)
      metrics["rollout/variance_kept_frac"] = kept / max(len(trajs), 1)
      rows, = distributed.agree_max([int(np.sum(batch.seq_ids.max(axis=1) >= 0))])
      batch = _pad_rows(batch, base * -(-max(int(rows), 1) // base))
    episode_tokens = int(np.sum(batch.seq_ids >= 0))
    if cfg.pack:
      batch = self._packed(batch)
      most_actions = self._most_in_loss(batch)
      length = batch.tokens.shape[1]  # tree rows are the largest bucket's
    held = int(np.sum((batch.seq_ids >= 0) | (batch.prefix_ids >= 0)))
    # How much of the step's rows is tokens, and what shared prompts saved.
    metrics["train/row_fill"] = held / batch.tokens.size
    metrics["train/shared_tokens"] = float(episode_tokens - held)
    metrics["train/batch_tokens"] = float(batch.loss_mask.sum())
    metrics["train/rows"] = float(batch.tokens.shape[0] * jax.process_count())
    metrics["train/row_length"] = float(batch.tokens.shape[1])
    metrics = self._combine(metrics, len(result.trajectories))
    num_actions = losses.action_bucket(int(most_actions), length)
    t0 = time.perf_counter()
    if self._worker is None:  # asynchronous: each rollout job brings its weights
      self.engine.sampler.drop_params()  # replaced after the step: not in its peak
    self.state, train_metrics = self.step(self.state, self._to_global(batch), num_actions)
    train_metrics = jax.device_get(train_metrics)
    metrics["time/step_s"] = time.perf_counter() - t0
    if self._worker is None:
      self.engine.sampler.update_params(self.state.model_params)
    skipped = float(train_metrics["skipped_updates"]) > 0
    self.bad_in_a_row = self.bad_in_a_row + 1 if skipped else 0
    if self.bad_in_a_row >= cfg.max_bad_steps:
      raise FloatingPointError(
          f"{self.bad_in_a_row} train steps in a row had a non-finite loss or "
          "gradient; stopping (lower the learning rate or check the rewards)")
    metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
    return metrics

  def _packed(self, batch: TokenBatch) -> TokenBatch:
    """`batch` packed (`RLConfig.pack`), in the row count every process
    agrees on; as it is where packing would not make it smaller."""
    multiple = self.cfg.pack_row_multiple
    packed = pack_batch(batch, multiple, share_prompts=self.cfg.share_prompts,
                        row_length=max(self.cfg.buckets) if self.cfg.share_prompts else None)
    rows, = distributed.agree_max([packed.tokens.shape[0]])
    rows = multiple * -(-int(rows) // multiple)
    if rows * packed.tokens.shape[1] >= batch.tokens.size:
      return batch
    return _pad_rows(packed, rows)

  def _most_in_loss(self, batch: TokenBatch) -> int:
    """The most loss tokens in a row of any process's batch."""
    most, = distributed.agree_max([int(batch.loss_mask.sum(axis=1).max(initial=0))])
    return int(most)

  def _to_global(self, batch: TokenBatch):
    return distributed.global_batch(batch, self._rows)

  def _trainable(self, trajs: Sequence[Trajectory], metrics: dict
                 ) -> tuple[list[Trajectory], list[Trajectory]]:
    """The episodes to train on (env faults and episodes without an action
    left out), as recorded and overlong-shaped (the same list when shaping
    is off); adds their env steps and penalties to `metrics`."""
    trajs = [t for t in trajs
             if t.metadata["stop_reason"] not in _ENV_FAULTS and t.num_turns > 0]
    metrics["rollout/env_steps"] = (metrics.get("rollout/env_steps", 0.0)
                                    + float(sum(t.num_turns for t in trajs)))
    shaped, penalties = self._shaped(trajs)
    if self.cfg.overlong_buffer:
      metrics["rollout/overlong_frac"] = float(np.mean(penalties > 0)) if trajs else 0.0
      metrics["rollout/overlong_penalty_mean"] = float(np.mean(penalties)) if trajs else 0.0
    return trajs, shaped

  def _shaped(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], np.ndarray]:
    """`overlong_shaped(trajs)` under this config; `trajs` itself when it is off."""
    if not self.cfg.overlong_buffer:
      return trajs, np.zeros(len(trajs), np.float32)
    return overlong_shaped(trajs, self.engine.max_context, self.cfg.overlong_buffer,
                           self.cfg.overlong_penalty)

  def _assign(self, batch: TokenBatch, outcomes: list[Trajectory], trajs: list[Trajectory],
              tasks: Sequence[Task], it: int, metrics: dict, salt: int = 0
              ) -> tuple[TokenBatch, np.ndarray]:
    """Credit assignment on the shaped episodes `trajs` (with the value
    forward or branches the scheme needs; the continuations shaped alike, so
    every sample of V(s_t) is), then the truncated episodes' loss masked if
    so configured. Returns the batch and the advantages [B, L] the episodes
    get unshaped (`outcomes`), which filtering reads: DAPO drops a group by
    its outcomes, whatever the overlong penalty (eq. 11)."""
    cfg = self.cfg
    values = (distributed.local_rows(self._values(self.state.model_params, self._to_global(batch)))
              if self._credit.needs_values else None)
    branches = {}
    if self._credit.needs_branches:
      episodes, steps = 0.0, 0.0
      if trajs:
        branches, episodes, steps = branches_of(
            self.engine, tasks, outcomes, cfg.branch_size, policy_version=it,
            seed=(self.seed * 1_000_003 + it + 500_009 + salt) % 2**31)
      metrics["rollout/branch_episodes"] = metrics.get("rollout/branch_episodes", 0.0) + episodes
      metrics["rollout/env_steps"] += steps
      if trajs:
        for k in ("forked", "fed_tokens", "generated_tokens", "generation_s"):
          name = f"rollout/branch_{k}"
          metrics[name] = metrics.get(name, 0.0) + self.engine.branch_metrics[k]
    if not trajs:
      return batch, batch.advantages

    def credited(episodes, continuations):
      branch_values = (credit.branch_returns(episodes, continuations, gamma=cfg.gamma,
                                             num_turns=self.engine.config.max_turns)
                       if self._credit.needs_branches else None)
      return credit.assign(cfg.credit, episodes, batch, gamma=cfg.gamma, lam=cfg.lam,
                           num_turns=self.engine.config.max_turns, token_values=values,
                           branch_values=branch_values, whiten=cfg.whiten_advantages)

    out = credited(trajs, {p: self._shaped(c)[0] for p, c in branches.items()})
    outcome_advantages = (credited(outcomes, branches).advantages
                          if cfg.filter_zero_variance and trajs is not outcomes
                          else out.advantages)
    if cfg.observation_loss:
      out, added = observation_credit(out)
      lp = distributed.local_rows(self._logprobs(
          self.state.model_params, self._to_global(out),
          losses.action_bucket(self._most_in_loss(out), out.tokens.shape[1])))
      # The trainer's own: importance weight 1 on tokens nobody sampled.
      out = out.replace(
          old_logprobs=np.where(added, np.asarray(lp), out.old_logprobs),
          sampling_logprobs=np.where(added, np.asarray(lp), out.sampling_logprobs))
    if cfg.mask_truncated:
      truncated = np.asarray([t.truncated for t in trajs] + [False])  # [-1]: padding
      out = out.replace(loss_mask=np.where(truncated[out.seq_ids], 0.0,
                                           out.loss_mask).astype(np.float32))
    return out, outcome_advantages

  def _refill(self, batch: TokenBatch, groups: int, num_trajs: int, it: int,
              refill: Callable[[int], Sequence[Task]], metrics: dict) -> TokenBatch:
    """DAPO's dynamic sampling: rolls out more tasks until the batch holds
    tasks_per_iteration groups with signal or `max_refill_tasks` are spent;
    appends the new groups' rows (their seq ids after the batch's)."""
    cfg = self.cfg
    used = rounds = 0
    metrics["rollout/refill_episodes"] = 0.0
    while groups < cfg.tasks_per_iteration and used < cfg.max_refill_tasks:
      n = min(cfg.tasks_per_iteration - groups, cfg.max_refill_tasks - used)
      more = list(refill(n))[:n]
      if not more:
        break
      used, rounds = used + len(more), rounds + 1
      result = self.engine.run(more, cfg.group_size, policy_version=it, seed=(
          self.seed * 1_000_003 + it + 104_729 * rounds) % 2**31, keep_caches=self._keep_caches)
      metrics["rollout/refill_episodes"] += len(result.trajectories)
      counts = {}  # the overlong metrics describe the first round's episodes
      new_outcomes, new = self._trainable(result.trajectories, counts)
      metrics["rollout/env_steps"] += counts["rollout/env_steps"]
      if not new:
        continue
      base = cfg.tasks_per_iteration * cfg.group_size
      views = sum(t.num_views for t in new)
      longest = max(len(f.ids) for t in new for f in t.flatten_views())
      extra = collate(new, buckets=(bucket_length(longest, cfg.buckets),),
                      num_rows=base * -(-views // base))
      extra, outcome_advantages = self._assign(extra, new_outcomes, new, more, it, metrics,
                                               salt=104_729 * rounds)
      extra, _, kept, _ = _keep_groups_with_signal(extra, new, outcome_advantages)
      groups += kept
      extra = extra.replace(seq_ids=np.where(extra.seq_ids >= 0, extra.seq_ids + num_trajs,
                                             -1).astype(np.int32))
      num_trajs += len(new)
      batch = _concat_rows(batch, extra)
    metrics["rollout/refill_tasks"] = float(used)
    metrics["rollout/informative_groups"] = float(groups)
    # Seq ids 0..k-1 again, as `distributed.global_batch` expects.
    ids = batch.seq_ids
    _, dense = np.unique(np.where(ids >= 0, ids, -1), return_inverse=True)
    dense = dense.reshape(ids.shape) - (ids < 0).any()
    return batch.replace(seq_ids=np.where(ids >= 0, dense, -1).astype(np.int32))

  def _skip(self, metrics: dict[str, float], episodes: int) -> dict[str, float]:
    metrics = self._combine(metrics, episodes)
    metrics["train/skipped_batch"] = 1.0
    return metrics

  @staticmethod
  def _combine(metrics: dict[str, float], episodes: int) -> dict[str, float]:
    """This process's rollout metrics -> those over every process."""
    return distributed.combine(metrics, episodes, sums=_SUMS, maxima=_MAXIMA)

def branches_of(engine: RolloutEngine, tasks: Sequence[Task], trajs: Sequence[Trajectory],
                branch_size: int, *, policy_version: int = 0, seed: int | None = None):
  """Continuations from every intermediate state, for `credit.branch_returns`.

  Samples `branch_size` continuations before every turn t >= 1 of every
  trajectory (the tasks they came from must be in `tasks`). Returns
  ({(i, t): trajectory i's continuations from turn t}, continuations run,
  env steps they sampled, replayed turns aside).
  """
  task_of = {t.task_id: t for t in tasks}
  points = [(i, t) for i, traj in enumerate(trajs) for t in range(1, traj.num_turns)]
  continuations = engine.branch(
      [(task_of[trajs[i].metadata["task_id"]], trajs[i], t) for i, t in points],
      branch_size, policy_version=policy_version, seed=seed) if points else []
  # A continuation an env fault ended estimates nothing: left out.
  continuations = [[c for c in conts if c.metadata["stop_reason"] not in _ENV_FAULTS]
                   for conts in continuations]
  steps = sum(c.num_turns - t for (_, t), conts in zip(points, continuations)
              for c in conts)
  return dict(zip(points, continuations)), float(len(points) * branch_size), float(steps)


def branch_values_of(engine: RolloutEngine, tasks: Sequence[Task],
                     trajs: Sequence[Trajectory], branch_size: int, *, gamma: float,
                     policy_version: int = 0, seed: int | None = None):
  """`branches_of` -> (`credit.branch_returns`, continuations run, env steps)."""
  branches, episodes, steps = branches_of(engine, tasks, trajs, branch_size,
                                          policy_version=policy_version, seed=seed)
  return (credit.branch_returns(trajs, branches, gamma=gamma,
                                num_turns=engine.config.max_turns), episodes, steps)


def _padding_batch(num_rows: int, length: int) -> TokenBatch:
  """[num_rows, length] of padding only: a process whose groups were all
  filtered out still contributes its rows to the global batch."""
  zeros = lambda dtype: np.zeros((num_rows, length), dtype)
  empty = np.full((num_rows, length), -1, np.int32)
  return TokenBatch(tokens=zeros(np.int32), loss_mask=zeros(np.float32),
                    old_logprobs=zeros(np.float32), sampling_logprobs=zeros(np.float32),
                    advantages=zeros(np.float32),
                    turn_index=empty, seq_ids=empty.copy(), positions=zeros(np.int32),
                    returns=zeros(np.float32), prefix_ids=empty.copy())


def _keep_groups_with_signal(batch: TokenBatch, trajs: Sequence[Trajectory],
                             advantages: np.ndarray) -> tuple[TokenBatch, int, int, int]:
  """Removes the rows of every group whose advantages are all exactly 0.

  Such a group adds nothing to the policy gradient (its surrogate's
  gradient is A x ratio-gradient = 0) but costs a forward and a backward.
  The test is on the trained tokens' `advantages` [B, L], those the credit
  scheme gives the episodes before overlong shaping, not on the rewards:
  equal rewards still carry per-turn signal under turn-level credit, and a
  group of right answers one of which ran overlong carries none (DAPO
  filters on the outcome, eq. 11; veRL's `acc`). Under group-relative
  credit that is DAPO's rule; a singleton group (group_size 1) is then
  always dropped (its baseline is itself), and kept under credit without a
  group baseline (turn_returns, gae) unless its advantages are all 0.
  Returns the kept rows (compacted, the same width), how many trajectories
  and groups they hold, and how many groups had no signal.
  """
  groups = np.asarray([t.metadata["group_id"] for t in trajs])
  ids = batch.seq_ids
  signal = np.zeros(len(trajs), bool)
  on = (ids >= 0) & (batch.loss_mask > 0)
  np.logical_or.at(signal, ids[on], advantages[on] != 0)
  informative = {g for g, s in zip(groups.tolist(), signal) if s}
  keep_traj = np.asarray([g in informative for g in groups.tolist()] + [False])  # [-1]: padding
  keep = keep_traj[ids.max(axis=1)]
  return (jax.tree.map(lambda x: x[keep], batch), int(keep_traj.sum()), len(informative),
          len(set(groups.tolist())) - len(informative))


def _keep_most_varied_groups(batch: TokenBatch, trajs: Sequence[Trajectory],
                             frac: float) -> tuple[TokenBatch, int]:
  """The rows of the ceil(frac x groups) groups whose rewards have the
  largest standard deviation over the group, ties to the group seen first
  (RAGEN's rollout filter by reward variance, StarPO-S). `trajs` are the
  episodes unshaped, indexed by the batch's `seq_ids`. Returns the kept
  rows (compacted, the same width) and how many trajectories they hold.
  """
  groups = [t.metadata["group_id"] for t in trajs]
  order = list(dict.fromkeys(groups))
  rewards = np.asarray([t.reward for t in trajs], np.float64)
  members = np.asarray(groups)
  spread = np.asarray([rewards[members == g].std() for g in order])
  k = math.ceil(round(len(order) * frac, 9))  # 0.3 x 10 is 3, not 4
  kept = {order[i] for i in np.argsort(-spread, kind="stable")[:k]}
  keep_traj = np.asarray([g in kept for g in groups] + [False])  # [-1]: padding
  keep = keep_traj[batch.seq_ids.max(axis=1)]
  return jax.tree.map(lambda x: x[keep], batch), int(keep_traj.sum())


def overlong_shaped(trajs: Sequence[Trajectory], budget: int, buffer: int,
                    penalty: float) -> tuple[list[Trajectory], np.ndarray]:
  """DAPO's soft overlong punishment on episodes near the context budget.

  An episode whose longest context (its longest view under a sliding
  window) holds L tokens loses penalty x min(1, max(0, L - (budget -
  buffer)) / buffer) on its return and on its last turn's reward. Returns
  (the shaped trajectories, their penalties [N]).
  """
  out, penalties = [], []
  for t in trajs:
    length = max(len(v.ids) for v in t.flatten_views())
    p = penalty * min(1.0, max(0, length - (budget - buffer)) / buffer)
    penalties.append(p)
    if p > 0:
      turns = list(t.turn_rewards or [])
      if turns:
        turns[-1] -= p
      t = dataclasses.replace(t, reward=t.reward - p, turn_rewards=turns or t.turn_rewards,
                              metadata={**t.metadata, "overlong_penalty": p})
    out.append(t)
  return out, np.asarray(penalties, np.float32)


def _concat_rows(a: TokenBatch, b: TokenBatch) -> TokenBatch:
  """The rows of `a` then `b`, both padded to the longer length."""
  length = max(a.tokens.shape[1], b.tokens.shape[1])
  a, b = _pad_columns(a, length), _pad_columns(b, length)
  return jax.tree.map(lambda x, y: np.concatenate([x, y]), a, b)


def _pad_columns(batch: TokenBatch, length: int) -> TokenBatch:
  extra = _padding_batch(batch.tokens.shape[0], length - batch.tokens.shape[1])
  return jax.tree.map(lambda x, y: np.concatenate([x, y], axis=1), batch, extra)


def _pad_rows(batch: TokenBatch, num_rows: int) -> TokenBatch:
  """Appends padding rows up to `num_rows`."""
  pad = _padding_batch(num_rows - batch.tokens.shape[0], batch.tokens.shape[1])
  return jax.tree.map(lambda a, b: np.concatenate([a, b]), batch, pad)
