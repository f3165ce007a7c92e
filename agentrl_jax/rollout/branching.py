"""Branching: continuations from an intermediate state of a recorded episode.

A fresh environment is reset and replayed through the recorded actions
(their observations and rewards must come back identical, else the
environment is not replayable and branching raises), and the policy samples
on from there under the same budgets: a `BranchEpisode` is an `Episode`
whose first call is that replay. The slot gets the recorded prefix's
keys/values by forking: a keeping run (`run(..., keep_caches=True)`)
snapshots each finished episode's cache on device (`Sampler.snapshot`, the
smallest attention window that holds it) before its slot is reused, and a
continuation copies the snapshot's prefix into its own slot and computes
only the prefix's last token (its next-token logits) and its new tokens.
Without a snapshot from the same policy version, the slot is prefilled
with the whole prefix. Snapshots, not held slots: a run with more episodes
than slots would stall if finished episodes kept theirs. They cost one
window of keys/values per episode until the next `branch` (which drops
them) or keeping run.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Callable, Sequence

from agentrl_jax import env_calls
from agentrl_jax.envs.base import Environment, StepResult, Task
from agentrl_jax.rollout.episode import Episode, EnvCall, Feed, TurnFormat
from agentrl_jax.rollout.groups import GroupQueue
from agentrl_jax.rollout.scheduler import SlotScheduler
from agentrl_jax.rollout.stats import RunStats
from agentrl_jax.trajectory import Role, Segment, Trajectory


@dataclasses.dataclass
class Replayed:
  """What a replay in the env's thread returned."""
  observation: str  # the reset observation
  state_key: Any  # the reset state's info["state_key"] (None without one)
  steps: list[StepResult]  # what each replayed action returned


@dataclasses.dataclass
class Kept:
  """A finished episode's cache, kept for continuations to fork from."""
  snapshot: Any  # sampling.SlotSnapshot of the episode's cache
  tokens: list[int]  # the tokens it holds
  version: int | None  # the policy version that computed them


def _replay(env: Environment, task: Task, actions: list[str]) -> Replayed:
  """Resets and replays the recorded actions (in the env's thread)."""
  observation, info = env_calls.checked_reset(env.reset(task))
  return Replayed(observation, info.get("state_key"),
                  [env_calls.checked_step(env.step(a)) for a in actions])


@dataclasses.dataclass(eq=False)
class BranchEpisode(Episode):
  """An episode that starts from a recorded prefix instead of a reset."""

  # The recorded SYSTEM segment, then (ASSISTANT, OBSERVATION) per replayed turn.
  recorded_prefix: list[Segment] = dataclasses.field(default_factory=list)
  recorded_actions: list[str] = dataclasses.field(default_factory=list)  # their texts
  recorded_rewards: list[float] = dataclasses.field(default_factory=list)
  source: Kept | None = None  # the kept cache to fork the prefix from

  def start(self) -> EnvCall:
    return self._call(self._on_replayed, _replay, self.env, self.task,
                      self.recorded_actions, count=1 + len(self.recorded_actions))

  def _on_replayed(self, replayed: Replayed) -> None:
    """Checks the replay reproduced the recording, then queues the prefix."""
    def mismatch(what):
      raise ValueError(
          f"task {self.task.task_id}: replaying the recorded actions gave a different "
          f"{what}; branching needs an environment that replays exactly")
    prompt = self.turn_format.prompt_ids(replayed.observation)
    if tuple(prompt) != self.recorded_prefix[0].token_ids:
      mismatch("prompt")
    self.state_keys = [replayed.state_key]
    for k, result in enumerate(replayed.steps):
      action, recorded = self.recorded_prefix[1 + 2 * k], self.recorded_prefix[2 + 2 * k]
      self.observation = self.turn_format.clip_observation(result.observation)
      delta = self.turn_format.observation_ids(self.observation, action.token_ids)
      if result.terminated or result.truncated or tuple(delta) != recorded.token_ids:
        mismatch(f"observation after turn {k}")
      if k < len(self.recorded_rewards) and result.reward != self.recorded_rewards[k]:
        mismatch(f"reward at turn {k}")
      self.steps.count(result)
      self.state_keys.append(result.info.get("state_key"))
    self.segments = list(self.recorded_prefix)
    self.context_starts = [self.context_start] * len(replayed.steps)
    prefix = self.context_ids()
    if self.source is None:
      self.pending = Feed(prefix, prefill=True)
    else:  # all but the last token forked; that one gives the next-token logits
      self.pending = Feed(prefix[-1:], prefill=False,
                          fork=(self.source.snapshot, len(prefix) - 1))


class Brancher:
  """Keeps finished episodes' caches and samples continuations from them."""

  def __init__(self, scheduler: SlotScheduler, turn_format: TurnFormat,
               env_factory: Callable[[], Environment]):
    self._scheduler, self._turn_format = scheduler, turn_format
    self._env_factory = env_factory
    self._kept: dict[int, Kept] = {}
    self._snapshot_ids = itertools.count()
    self.metrics: dict[str, float] = {}  # the last `branch` call's

  def drop_kept(self) -> None:
    self._kept = {}

  def keep(self, ep: Episode, version: int | None) -> None:
    """Snapshots a finished episode's cache before its slot is reused."""
    if ep.slot < 0 or ep.cached_tokens == 0:
      return
    snapshot_id = next(self._snapshot_ids)
    ep.extra_metadata["snapshot_id"] = snapshot_id  # for `branch` to find it by
    scheduler = self._scheduler
    self._kept[snapshot_id] = Kept(
        scheduler.sampler.snapshot(scheduler.state, ep.slot, ep.cached_tokens),
        [t for s in ep.segments for t in s.token_ids][:ep.cached_tokens], version)

  def branch(self, points: Sequence[tuple[Task, Trajectory, int]], n: int,
             queue: GroupQueue, *, version: int, temperature: float,
             record: Callable[[Episode, int], Trajectory]) -> list[list[Trajectory]]:
    """`RolloutEngine.branch` on an engine carrying nothing; `queue` is empty."""
    episodes, group_of_point = [], []
    for task, traj, t in points:
      if not 0 <= t < traj.num_turns:
        raise ValueError(f"branch turn {t} outside the trajectory's "
                         f"{traj.num_turns} turns")
      if traj.context_starts is not None:
        raise ValueError("cannot branch a sliding-window trajectory")
      roles = [s.role for s in traj.segments[:1 + 2 * t]]
      if roles != [Role.SYSTEM] + [Role.ASSISTANT, Role.OBSERVATION] * t:
        raise ValueError("branching needs the rollout's layout: SYSTEM, then "
                         "(ASSISTANT, OBSERVATION) per turn")
      group = queue.new_group(n)
      group_of_point.append(group)
      texts = [self._turn_format.tok.decode(s.token_ids)
               for s in traj.segments[1:1 + 2 * t:2]]
      source = self._source(traj, t, version)
      for _ in range(n):
        episodes.append(BranchEpisode(
            task=task, group=group, env=self._env_factory(),
            turn_format=self._turn_format,
            recorded_prefix=traj.segments[:1 + 2 * t], recorded_actions=texts,
            recorded_rewards=list(traj.turn_rewards or [])[:t],
            versions=list(traj.metadata.get("policy_versions", []))[:t],
            stop_reasons=list(traj.metadata.get("stop_reasons", []))[:t],
            source=source))
    stats = RunStats()
    try:
      queue.add(self._scheduler.run(episodes, stats, version=version,
                                    temperature=temperature))
    finally:
      self._kept = {}
    by_group = collections.defaultdict(list)
    for ep in queue.pop_complete():
      if ep.segments:  # (a replay whose env failed has none)
        by_group[ep.group].append(record(ep, version))
    self.metrics = {
        "continuations": float(len(episodes)),
        "forked": float(sum(ep.source is not None for ep in episodes)),
        "fed_tokens": float(stats.fed_tokens),
        "generated_tokens": float(stats.generated_tokens),
        "generation_s": stats.generation, "env_wait_s": stats.env_wait}
    return [by_group[g] for g in group_of_point]

  def _source(self, traj: Trajectory, t: int, version: int) -> Kept | None:
    """The kept cache holding `traj`'s prefix before action t, if any."""
    kept = self._kept.get(traj.metadata.get("snapshot_id"))
    if kept is None or kept.version != version:
      return None  # no snapshot, or keys/values of other weights
    prefix = [i for s in traj.segments[:1 + 2 * t] for i in s.token_ids]
    if len(prefix) > kept.snapshot.length or kept.tokens[:len(prefix)] != prefix:
      raise ValueError("the trajectory's tokens differ from those its snapshot cached")
    return kept
