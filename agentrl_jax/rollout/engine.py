"""RolloutEngine: G rollouts per task through the sampler and the environments.

The engine makes the episodes (`episode.py`), runs them on the slot
scheduler (`scheduler.py`), hands out complete groups (`groups.py`) and
samples continuations (`branching.py`). Each episode gets its own
environment instance from the factory (group members never share one). An
episode that failed before it had a prompt has no tokens: it is reported in
`RolloutResult.failed`.

Partial rollouts: with `token_budget`, `run` stops decoding once this call
generated that many tokens; unfinished episodes (and finished members of
unfinished groups) carry over to the next call. If the policy changed in
between (`policy_version`), carried episodes re-prefill their whole context,
since their cached keys/values came from the old weights; every turn records
the policy version that sampled it. An isolated run (an evaluation in
between) sets them aside, snapshotting the slots it needs, and puts them
back: it sees every slot, and they go on bit-identically.

Expert mode (`run(..., expert=True)`) replaces the sampler with the
environment's scripted expert: its action text is encoded once and recorded
without log-probs, through the same bookkeeping (for SFT warm starts).

The environment's declarations (system prompt, stop strings, tool schemas:
`envs.contract`) are checked when the engine is built; the tool schemas go
into the prompt through the chat format. An episode succeeds when it
terminated and its last step reported `info["success"]`.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import Callable, Sequence

from agentrl_jax import tokenizer as tok_lib
from agentrl_jax.envs import contract
from agentrl_jax.envs.base import Environment, Task
from agentrl_jax.rollout.branching import Brancher
from agentrl_jax.rollout.config import RolloutConfig
from agentrl_jax.rollout.episode import PROMPT_TOO_LONG, Episode, TurnFormat
from agentrl_jax.rollout.groups import GroupQueue
from agentrl_jax.rollout.scheduler import SlotScheduler
from agentrl_jax.rollout.stats import RunStats
from agentrl_jax.sampling import Sampler
from agentrl_jax.trajectory import Trajectory


@dataclasses.dataclass
class RolloutResult:
  trajectories: list[Trajectory]  # complete groups, group members adjacent
  metrics: dict[str, float]
  # Episodes that failed before they had a prompt (reset timed out or
  # failed): their task_id, group_id, stop_reason and env_error.
  failed: list[dict] = dataclasses.field(default_factory=list)


class RolloutEngine:
  """Runs G rollouts per task through the sampler and the environments."""

  def __init__(self, env_factory: Callable[[], Environment], tokenizer,
               chat_format: tok_lib.ChatFormat, sampler: Sampler | None = None,
               config: RolloutConfig = RolloutConfig(), *, seed: int = 0):
    self.env_factory, self.tok, self.fmt = env_factory, tokenizer, chat_format
    self.sampler, self.config = sampler, config
    if config.context_window is not None and config.context_window < 1:
      raise ValueError(f"context_window must be >= 1 turn (or None), got "
                       f"{config.context_window}")
    if sampler is not None and config.max_action_tokens > sampler.max_decode_length:
      raise ValueError(f"max_action_tokens {config.max_action_tokens} > sampler "
                       f"max_decode_length {sampler.max_decode_length}")
    probe = env_factory()
    try:
      spec = contract.check(probe)
    finally:
      probe.close()
    self.env_name = spec.name
    self.system_prompt = (config.system_prompt if config.system_prompt is not None
                          else spec.system_prompt)
    self.stop_strings, self.tools = spec.stop_strings, spec.tools
    chat_format.system_text(self.system_prompt, self.tools)  # renders them, or raises
    self._warned_success = False
    self.stops = chat_format.stop_matcher(
        tokenizer, extra=self.stop_strings,
        vocab_size=sampler.cfg.vocab_size if sampler is not None else None)
    # Expert episodes obey the same context budget as sampled ones would.
    self.max_context = (sampler.cache_length if sampler is not None
                        else config.max_context)
    self._turn_format = TurnFormat(
        tokenizer, chat_format, self.system_prompt, self.tools, self.stop_strings,
        self.max_context, config.max_turns, config.max_observation_tokens,
        config.context_window, config.min_action_tokens)
    self._scheduler = SlotScheduler(sampler, config, self.stops, seed)
    self._group_ids = itertools.count()  # unique across queues: they order groups
    self._queue = GroupQueue(self._group_ids)  # carried between calls
    self._brancher = Brancher(self._scheduler, self._turn_format, env_factory)

  def close(self):
    """Closes the environments' worker threads (never waits on a hung call)."""
    self._scheduler.calls.close()

  @property
  def abandoned_calls(self) -> int:
    """Environment calls abandoned past their deadline (their threads hang on)."""
    return self._scheduler.calls.abandoned

  @property
  def carried(self) -> int:
    """Episodes carried over to the next call (unfinished, or waiting for
    their group)."""
    return len(self._queue)

  @property
  def branch_metrics(self) -> dict[str, float]:
    """The last `branch` call's counts: continuations, forked, tokens, seconds."""
    return self._brancher.metrics

  @property
  def _free(self) -> list[int]:
    """The free sampler slots (tests/test_rollout.py checks a carry holds all)."""
    return self._scheduler.free

  def warmup(self) -> None:
    """Compiles every sampler shape up front (see `Sampler.warmup`)."""
    if self._queue:
      raise ValueError("warm up before rolling out, not between partial rollouts")
    self._scheduler.state = self.sampler.warmup(self._scheduler.state)

  def run(self, tasks: Sequence[Task], group_size: int = 1, *,
          policy_version: int = 0, token_budget: int | None = None,
          expert: bool = False, temperature: float | None = None,
          seed: int | None = None, isolated: bool = False,
          keep_caches: bool = False) -> RolloutResult:
    """Rolls out `group_size` episodes per task (plus carried-over ones).

    `temperature` overrides the configured one for this call (e.g. 0 for
    greedy evaluation). `seed` re-seeds the sampler's random stream, so a
    call's samples do not depend on what earlier calls drew (a resumed run
    then continues exactly). Returns the trajectories of every group that
    completed in this call. `isolated`: run only these tasks, to the end,
    as on an engine that carries nothing, and leave carried-over partial
    rollouts for the next call exactly as they were
    (`SlotScheduler.set_aside`), e.g. an evaluation between training
    iterations; it keeps no caches.
    `keep_caches`: snapshot every finished episode's cache for `branch` to
    fork from (dropping earlier snapshots); see `branching`.
    """
    if not isolated:
      return self._run(tasks, group_size, self._queue, policy_version=policy_version,
                       token_budget=token_budget, expert=expert, temperature=temperature,
                       seed=seed, keep_caches=keep_caches)
    if token_budget is not None:
      raise ValueError("an isolated run finishes its episodes: no token_budget")
    with self._scheduler.set_aside(self._queue.unfinished, len(tasks) * group_size, expert):
      return self._run(tasks, group_size, GroupQueue(self._group_ids),
                       policy_version=policy_version, token_budget=None, expert=expert,
                       temperature=temperature, seed=seed, keep_caches=False)

  def branch(self, points: Sequence[tuple[Task, Trajectory, int]], n: int, *,
             policy_version: int = 0, temperature: float | None = None,
             seed: int | None = None) -> list[list[Trajectory]]:
    """Samples `n` continuations from intermediate states of recorded episodes.

    points: (task, trajectory, t) triples: continue `trajectory` (recorded by
      this engine with an append-only context) from the state just before
      its action t, 0 <= t < num_turns. Each continuation gets a fresh
      environment, reset on `task` and replayed through actions 0..t-1,
      whose observations and rewards must come back identical (ValueError
      otherwise: branching needs a replayable environment).
    Returns, per point, its n continuations as full trajectories (the
    recorded prefix, then the new turns); `max_turns` counts the replayed
    turns too. A trajectory from a `keep_caches` run of the same policy
    version forks its cached prefix, others prefill it (`branch_metrics`
    counts both and the tokens the sampler computed); the snapshots are
    dropped afterwards.
    """
    if self._queue:
      raise ValueError("finish carried-over rollouts before branching")
    if self.config.context_window is not None:
      raise ValueError("branching needs an append-only context (context_window=None)")
    if self.sampler is None:
      raise ValueError("branching samples from the policy: it needs a sampler")
    self._scheduler.reseed(seed)
    return self._brancher.branch(
        points, n, GroupQueue(self._group_ids), version=policy_version,
        temperature=self._temperature(temperature), record=self._record)

  def _run(self, tasks: Sequence[Task], group_size: int, queue: GroupQueue, *,
           policy_version: int, token_budget: int | None, expert: bool,
           temperature: float | None, seed: int | None,
           keep_caches: bool) -> RolloutResult:
    """`run` with `queue` holding what carries over between calls."""
    if keep_caches and (expert or token_budget is not None
                        or self.config.context_window is not None):
      raise ValueError("keep_caches is for branching: policy rollouts to the end "
                       "(no token_budget) with an append-only context")
    if keep_caches:
      self._brancher.drop_kept()
    self._scheduler.reseed(seed)
    if not expert and self.sampler is None:
      raise ValueError("policy rollouts need a sampler (or pass expert=True)")
    if expert and queue:
      raise ValueError("finish carried-over policy rollouts before expert ones")
    new = []
    for task in tasks:
      group = queue.new_group(group_size)
      for _ in range(group_size):
        env = self.env_factory()
        new.append(Episode(task=task, group=group, env=env,
                           turn_format=self._turn_format,
                           expert=env.expert(task) if expert else None))
    if queue.version is not None and policy_version != queue.version:
      for ep in queue.unfinished:
        ep.refeed()
    queue.version = policy_version
    stats = RunStats(abandoned=self._scheduler.calls.abandoned)
    keep = (lambda ep: self._brancher.keep(ep, policy_version)) if keep_caches else None
    queue.add(self._scheduler.run(
        queue.unfinished + new, stats, version=policy_version,
        temperature=self._temperature(temperature), expert=expert,
        token_budget=token_budget, on_finished=keep))
    done = queue.pop_complete()
    trajectories = [self._record(ep, policy_version) for ep in done if ep.segments]
    failed = [ep.failure() for ep in done if not ep.segments]
    self._long_prompts(failed)
    cut = sorted({ep.task.task_id for ep in done if ep.extra_metadata.get("prompt_cut")}, key=str)
    if cut:
      warnings.warn(f"{len(cut)} task(s) have a reset observation longer than "
                    f"rollout.max_observation_tokens={self.config.max_observation_tokens}, "
                    f"cut with a marker: {cut}", RuntimeWarning, stacklevel=2)
    calls = self._scheduler.calls
    return RolloutResult(trajectories, stats.summary(
        trajectories, failed, calls.drain_latencies(), calls.abandoned - stats.abandoned),
        failed)

  def _long_prompts(self, failed: list[dict]) -> None:
    """One warning naming the tasks whose prompts did not fit (or, with
    long_prompts="error", a ValueError)."""
    ids = sorted({f["task_id"] for f in failed if f["stop_reason"] == PROMPT_TOO_LONG}, key=str)
    if not ids:
      return
    what = (f"{len(ids)} task(s) have a prompt that leaves no room for "
            f"rollout.min_action_tokens={self.config.min_action_tokens} in the "
            f"{self.max_context}-token context: {ids}")
    if self.config.long_prompts == "error":
      raise ValueError(f"{what} (rollout.long_prompts='error'; shorten the system prompt "
                       "or tools, or lower rollout.max_observation_tokens)")
    warnings.warn(f"{what}; their episodes are dropped (rollout/ended/{PROMPT_TOO_LONG})",
                  RuntimeWarning, stacklevel=3)

  def _temperature(self, override: float | None) -> float:
    return self.config.temperature if override is None else override

  def _record(self, ep: Episode, version: int) -> Trajectory:
    """The episode's trajectory; warns once if an env never reports success."""
    if ep.terminated and ep.steps.success is None and not self._warned_success:
      self._warned_success = True
      warnings.warn(f"environment {self.env_name} ended an episode without "
                    "info['success']: its episodes count as failures (see "
                    "agentrl_jax.envs.contract)", stacklevel=2)
    return ep.to_trajectory(version, bool(ep.terminated and ep.steps.success))
