"""RolloutEngine: many episodes at once on the sampler's slots.

The loop (plain Python; only the sampler is jitted):

  admit     new episodes take free slots; `env.reset` runs in the thread pool
  collect   finished env calls: the prompt or the observation delta becomes
            the slot's pending tokens (encoded once, never re-rendered)
  feed      one `prefill` for new episodes, one `extend` for the others
  act       one batched `decode` for the episodes waiting for an action
            (at most `max_decode_batch`, longest-waiting first); each action
            goes to its own environment in the thread pool

Environment calls run concurrently in threads while the sampler keeps
decoding for the episodes whose observations are back, so a slow tool does
not idle the accelerator. Each episode gets its own environment instance
from the factory (group members never share one). Every call goes through
`env_calls.EnvCaller`: a call past its deadline (`env_deadline_s`, or the
environment's own `deadline_s`) ends its episode as truncated with stop
reason "env_timeout"; an exception or a result outside the contract ends it
with "env_error" and the error text in `metadata["env_error"]`. The other
episodes go on, and the engine stays usable. An episode that failed before
it had a prompt has no tokens: it is reported in `RolloutResult.failed`.
Observations are cut by characters before they are tokenized, so a huge
one costs bounded work.

Each finished episode is recorded as a `Trajectory` whose ids are exactly
what the sampler consumed and produced: SYSTEM = the prompt delta,
ASSISTANT = the sampled tokens (the stop's tokens included) with their raw
log-probs, OBSERVATION = the observation delta (wrapper and next assistant
header included). A terminated episode ends on its last action; a truncated
one (turn budget, or the environment's truncation) ends on the observation
that followed it, the state its return bootstraps from (docs/design.md,
convention 4), unless that would overflow the context.

Partial rollouts: with `token_budget`, `run` stops decoding once this call
generated that many tokens; unfinished episodes (and finished members of
unfinished groups) carry over to the next call. If the policy changed in
between (`policy_version`), carried episodes re-prefill their whole context,
since their cached keys/values came from the old weights; every turn records
the policy version that sampled it. An isolated run (an evaluation in
between) sets them aside, snapshotting the slots it needs, and puts them
back: it sees every slot, and they go on bit-identically.

Context policies: append-only (default) keeps every turn in the cache, so
each observation costs one `extend` of its own tokens. A sliding window
(`context_window=k`) keeps the prompt and the last k turns (action plus
observation): once an episode has more than k turns, the window moves every
turn and the slot is re-prefilled with prompt + window, i.e. each turn costs
a prefill of ~prompt + k turns instead of an extend of one observation (see
`benchmarks/rollout.py`). The trajectory records each action's window
(`Trajectory.context_starts`), and training teacher-forces every action in
the context it was sampled in (`Trajectory.flatten_views`).

Branching (`branch`): continuations from an intermediate state of a
recorded episode. A fresh environment is reset and replayed through the
recorded actions (their observations and rewards must come back identical,
else the environment is not replayable and branching raises), and the
policy samples on from there under the same budgets. The slot gets the
recorded prefix's keys/values by forking: `run(..., keep_caches=True)`
snapshots each finished episode's cache on device (`Sampler.snapshot`, the
smallest attention window that holds it) before its slot is reused, and a
continuation copies the snapshot's prefix into its own slot and computes
only the prefix's last token (its next-token logits) and its new tokens.
Without a snapshot from the same policy version, the slot is prefilled
with the whole prefix. Snapshots, not held slots: a run with more episodes
than slots would stall if finished episodes kept theirs. They cost one
window of keys/values per episode until the next `branch` (which drops
them) or keeping `run`.

Expert mode (`run(..., expert=True)`) replaces the sampler with the
environment's scripted expert: its action text is encoded once and recorded
without log-probs, through the same bookkeeping (for SFT warm starts). An
expert action that ends on no stop string gets the chat format's end of
turn, the token a policy must write to end its turn.

The environment's declarations (system prompt, stop strings, tool schemas:
`envs.contract`) are checked when the engine is built; the tool schemas go
into the prompt through the chat format, and an observation may be a list
of texts (one per tool call). An episode succeeds when it terminated and
its last step reported `info["success"]`.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import itertools
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax import env_calls
from agentrl_jax.checks import check_fields
from agentrl_jax import tokenizer as tok_lib
from agentrl_jax.envs import contract
from agentrl_jax.envs.base import Environment, StepResult, Task
from agentrl_jax.sampling import STOP_SEQUENCE, Sampler
from agentrl_jax.trajectory import Role, Segment, Trajectory

TRUNCATION_MARKER = " ...[truncated {} characters]"
# Observations are cut to this many characters per token of budget before
# tokenizing (bounded work on a huge one); tokens are rarely this long.
_CHARS_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  max_turns: int = 8
  max_action_tokens: int = 128  # per turn, at most the sampler's decode buffer
  max_observation_tokens: int = 256  # longer observations are cut, with a marker
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  env_workers: int = 16  # threads stepping environments concurrently
  # Seconds a reset or step may take before its episode ends as
  # "env_timeout" (None: wait forever); an environment's own `deadline_s`
  # attribute takes precedence.
  env_deadline_s: float | None = 60.0
  # Decode at most this many episodes per call (None: all that are ready).
  # Smaller calls let decoding of one cohort overlap the tool calls of
  # another when environments are slow: a tool call is hidden when the other
  # cohorts' decodes take as long (see benchmarks/rollout.py).
  max_decode_batch: int | None = None
  # Once an env call is back, wait up to this long for the rest of the calls
  # submitted with it, so a batch of tools returns to one decode instead of
  # trickling into many small ones.
  batch_wait_s: float = 0.005
  # Wait for every env call before each decode: batches (and so the random
  # numbers each episode draws) no longer depend on thread timing, which makes
  # runs bit-reproducible, at the cost of the tool/decode overlap.
  lockstep: bool = False
  system_prompt: str | None = None  # default: the environment's own
  # Sliding-window context policy: keep the prompt and the last k turns.
  # None: append-only (every turn stays in the cache; KV reuse).
  context_window: int | None = None
  max_context: int = 4096  # tokens per episode without a sampler (expert mode)

  def __post_init__(self):
    check_fields(self, [
        ("max_turns", self.max_turns >= 1, "must be >= 1"),
        ("max_action_tokens", self.max_action_tokens >= 1, "must be >= 1"),
        ("env_workers", self.env_workers >= 1, "must be >= 1"),
        ("context_window", self.context_window is None or self.context_window >= 1,
         "must be None or >= 1"),
    ])


@dataclasses.dataclass
class _Episode:
  task: Task
  group: int
  env: Environment
  expert: Any = None
  slot: int | None = None
  segments: list = dataclasses.field(default_factory=list)
  rewards: list = dataclasses.field(default_factory=list)
  parts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  turn_parts: list = dataclasses.field(default_factory=list)  # reward parts per step
  stop_reasons: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  context_start: int = 1  # segments[context_start:] follow the prompt in the cache
  context_starts: list = dataclasses.field(default_factory=list)  # per action
  state_keys: list = dataclasses.field(default_factory=list)  # info["state_key"] per state
  cached: int = 0  # tokens in the slot's cache
  snapshot_id: int | None = None  # its kept cache (`run(..., keep_caches=True)`)
  source: _Kept | None = None  # branch: the kept cache to fork the prefix from
  fork: tuple | None = None  # (snapshot, length) to fork the slot from before feeding
  pending: list | None = None  # tokens to feed before the next action
  fresh: bool = True  # pending starts the slot's context (prefill)
  observation: str = ""  # last observation (the expert's input)
  ready_at: int = 0  # when pending was queued (the longest-waiting decode first)
  batch: int = 0  # which submission round its env call came from
  replay: list | None = None  # recorded segments to replay before sampling (branch)
  replay_actions: list = dataclasses.field(default_factory=list)  # their action texts
  rewards_check: list = dataclasses.field(default_factory=list)  # recorded rewards
  tool_calls: int = 0
  tool_errors: int = 0
  success: bool | None = None  # the last step's info["success"]
  env_time: float = 0.0
  terminated: bool = False
  truncated: bool = False
  stop_reason: str | None = None  # see `STOP_REASONS`
  error: str | None = None  # the env_error / env_timeout text
  done: bool = False

  @property
  def context(self) -> list[Segment]:
    """The segments in the slot's cache (once pending is fed): prompt + window."""
    return self.segments[:1] + self.segments[self.context_start:]

  @property
  def length(self) -> int:
    """Tokens in the slot's cache once pending is fed."""
    return sum(len(s) for s in self.context)

  def finish(self, reason: str, error: str | None = None):
    self.terminated, self.truncated = reason == "terminated", reason != "terminated"
    self.stop_reason, self.error, self.done = reason, error, True


# Why an episode ended (`metadata["stop_reason"]`): the task ended; the turn
# budget, the environment's truncation or the context ran out; the
# environment failed (see `env_calls`).
STOP_REASONS = ("terminated", "max_turns", "env_truncated", "context",
                env_calls.ENV_TIMEOUT, env_calls.ENV_ERROR)


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
    self._state = sampler.init_state(seed) if sampler is not None else None
    self._free = list(range(sampler.num_slots)) if sampler is not None else []
    self._carry: list[_Episode] = []  # unfinished episodes (partial rollouts)
    self._finished: list[_Episode] = []  # finished members of open groups
    self._group_sizes: dict[int, int] = {}
    self._group_ids = itertools.count()
    self._version: int | None = None
    self._ticks = itertools.count()  # orders collections and submission rounds
    self._keep = False  # snapshot finished episodes' caches (for `branch`)
    self._kept: dict[int, _Kept] = {}
    self._snapshot_ids = itertools.count()
    self.branch_metrics: dict[str, float] = {}  # the last `branch` call's
    self._calls = env_calls.EnvCaller(config.env_workers)

  def close(self):
    """Closes the environments' worker threads (never waits on a hung call)."""
    self._calls.close()

  @property
  def abandoned_calls(self) -> int:
    """Environment calls abandoned past their deadline (their threads hang on)."""
    return self._calls.abandoned

  @property
  def carried(self) -> int:
    """Episodes carried over to the next call (unfinished, or waiting for
    their group)."""
    return len(self._carry) + len(self._finished)

  def warmup(self) -> None:
    """Compiles every sampler shape up front (see `Sampler.warmup`)."""
    if self._carry or self._finished:
      raise ValueError("warm up before rolling out, not between partial rollouts")
    self._state = self.sampler.warmup(self._state)

  # -- Public ----------------------------------------------------------------------

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
    rollouts for the next call exactly as they were (`_isolated`), e.g. an
    evaluation between training iterations.
    `keep_caches`: snapshot every finished episode's cache for `branch` to
    fork from (dropping earlier snapshots); see the module doc.
    """
    if isolated:
      if token_budget is not None:
        raise ValueError("an isolated run finishes its episodes: no token_budget")
      return self._isolated(tasks, group_size, policy_version=policy_version,
                            expert=expert, temperature=temperature, seed=seed)
    if keep_caches and (expert or token_budget is not None
                        or self.config.context_window is not None):
      raise ValueError("keep_caches is for branching: policy rollouts to the end "
                       "(no token_budget) with an append-only context")
    if keep_caches:
      self._kept = {}
    self._keep = keep_caches
    if seed is not None and self._state is not None:
      self._state = self._state.replace(rng=jax.random.key(seed))
    self._temperature = self.config.temperature if temperature is None else temperature
    if not expert and self.sampler is None:
      raise ValueError("policy rollouts need a sampler (or pass expert=True)")
    if expert and (self._carry or self._finished):
      raise ValueError("finish carried-over policy rollouts before expert ones")
    new = []
    for task in tasks:
      group = next(self._group_ids)
      self._group_sizes[group] = group_size
      for _ in range(group_size):
        env = self.env_factory()
        new.append(_Episode(task=task, group=group, env=env,
                            expert=env.expert(task) if expert else None))
    if self._version is not None and policy_version != self._version:
      for ep in self._carry:  # cached KV came from the old weights
        if ep.segments:  # (the pending observation is already a segment)
          ep.pending = [t for s in ep.context for t in s.token_ids]
          ep.fresh = True
    self._version = policy_version
    stats = _Stats(num_slots=self.sampler.num_slots if self.sampler else 0,
                   abandoned=self._calls.abandoned)
    active = self._loop(self._carry + new, expert, token_budget, stats)
    self._carry = [ep for ep in active if not ep.done]
    self._finished += [ep for ep in active if ep.done]
    done = self._complete_groups()
    trajectories = [self._record(ep) for ep in done if ep.segments]
    failed = [self._failure(ep) for ep in done if not ep.segments]
    return RolloutResult(trajectories, stats.summary(
        trajectories, failed, self._calls.drain_latencies(),
        self._calls.abandoned - stats.abandoned), failed)

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
    if self._carry or self._finished:
      raise ValueError("finish carried-over rollouts before branching")
    if self.config.context_window is not None:
      raise ValueError("branching needs an append-only context (context_window=None)")
    if self.sampler is None:
      raise ValueError("branching samples from the policy: it needs a sampler")
    if seed is not None:
      self._state = self._state.replace(rng=jax.random.key(seed))
    self._temperature = self.config.temperature if temperature is None else temperature
    self._version = policy_version
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
      group = next(self._group_ids)
      self._group_sizes[group] = n
      group_of_point.append(group)
      texts = [self.tok.decode(s.token_ids) for s in traj.segments[1:1 + 2 * t:2]]
      source = self._source(traj, t, policy_version)
      for _ in range(n):
        episodes.append(_Episode(task=task, group=group, env=self.env_factory(),
                                 replay=traj.segments[:1 + 2 * t], replay_actions=texts,
                                 rewards_check=list(traj.turn_rewards or [])[:t],
                                 versions=list(traj.metadata.get("policy_versions", []))[:t],
                                 stop_reasons=list(traj.metadata.get("stop_reasons", []))[:t],
                                 source=source))
    stats = _Stats(num_slots=self.sampler.num_slots)
    self._keep = False
    try:
      self._finished = self._loop(episodes, False, None, stats)
    finally:
      self._kept = {}
    by_group = collections.defaultdict(list)
    for ep in self._complete_groups():
      if ep.segments:  # (a replay whose env failed has none)
        by_group[ep.group].append(self._record(ep))
    self.branch_metrics = {
        "continuations": float(len(episodes)),
        "forked": float(sum(ep.source is not None for ep in episodes)),
        "fed_tokens": float(stats.fed_tokens),
        "generated_tokens": float(stats.generated_tokens),
        "generation_s": stats.generation, "env_wait_s": stats.env_wait}
    return [by_group[g] for g in group_of_point]

  def _isolated(self, tasks: Sequence[Task], group_size: int, **kwargs) -> RolloutResult:
    """`run` with the carried-over episodes set aside, and put back afterwards.

    Carried episodes keep their slots between calls; the ones this run needs
    beyond the free slots are snapshotted (`Sampler.snapshot`) and freed,
    then forked back into the same slots, with the free list and the
    sampler's random stream as they were: the carried episodes go on
    bit-identically, and this run sees the slots an engine carrying nothing
    would. Their next-token logits need no copy: a carried episode always
    has tokens pending (an observation, or its prompt), whose feed
    recomputes them.
    """
    saved = self._carry, self._finished, self._version, list(self._free)
    snapshots, rng = {}, None
    if self.sampler is not None and not kwargs["expert"]:
      held = [ep for ep in self._carry if ep.slot is not None and ep.slot >= 0]
      for ep in held[:max(len(tasks) * group_size - len(self._free), 0)]:
        if not ep.fresh:  # (a fresh one's prefill restarts its slot anyway)
          snapshots[ep.slot] = self.sampler.snapshot(self._state, ep.slot, ep.cached)
        self._free.append(ep.slot)
      rng = jnp.copy(self._state.rng)  # a copy: the decodes donate the state's
    self._carry, self._finished = [], []
    try:
      return self.run(tasks, group_size, **kwargs)
    finally:
      self._carry, self._finished, self._version, self._free = saved
      for slot, snapshot in snapshots.items():
        self._state = self.sampler.fork(self._state, slot, snapshot, snapshot.length)
      if rng is not None:
        self._state = self._state.replace(rng=rng)

  def _source(self, traj: Trajectory, t: int, version: int) -> _Kept | None:
    """The kept cache holding `traj`'s prefix before action t, if any."""
    kept = self._kept.get(traj.metadata.get("snapshot_id"))
    if kept is None or kept.version != version:
      return None  # no snapshot, or keys/values of other weights
    prefix = [i for s in traj.segments[:1 + 2 * t] for i in s.token_ids]
    if len(prefix) > kept.snapshot.length or kept.tokens[:len(prefix)] != prefix:
      raise ValueError("the trajectory's tokens differ from those its snapshot cached")
    return kept

  def _complete_groups(self) -> list[_Episode]:
    """Pops the finished episodes of every complete group, members adjacent."""
    groups = collections.defaultdict(list)
    for ep in self._finished:
      groups[ep.group].append(ep)
    complete = [g for g, eps in groups.items() if len(eps) == self._group_sizes[g]]
    done = [ep for g in sorted(complete) for ep in groups[g]]
    self._finished = [ep for ep in self._finished if ep.group not in complete]
    for g in complete:
      del self._group_sizes[g]
    return done

  # -- The loop ---------------------------------------------------------------------

  def _loop(self, episodes: list[_Episode], expert: bool,
            token_budget: int | None, stats: _Stats) -> list[_Episode]:
    waiting = collections.deque(ep for ep in episodes if ep.slot is None)
    running = [ep for ep in episodes if ep.slot is not None]
    in_flight: dict[cf.Future, _Episode] = {}
    generated = 0
    budget_spent = False
    ticks = self._ticks  # across calls: carried episodes keep their place
    while True:
      batch = next(ticks)
      while waiting and (expert or self._free) and not budget_spent:
        ep = waiting.popleft()
        ep.batch = batch
        ep.slot = -1 if expert else self._free.pop()
        running.append(ep)
        if ep.replay is not None:
          call = self._call(ep, self._replay, ep, ep.task,
                            calls=1 + len(ep.replay_actions))
        else:
          call = self._call(ep, ep.env.reset, ep.task, check=env_calls.checked_reset)
        in_flight[call] = ep
      t0 = time.perf_counter()
      done = (cf.wait(in_flight)[0] if budget_spent  # no more decodes: finish the calls
              else self._gather(in_flight, len(self._ready(running))))
      stats.env_wait += time.perf_counter() - t0
      for future in [f for f in in_flight if f in done]:  # submission order: deterministic
        ep = in_flight.pop(future)
        self._collect(ep, future.result())
        ep.ready_at = next(ticks)
      for ep in [ep for ep in running if ep.done and ep.slot is not None]:
        if self._keep:
          self._keep_cache(ep)
        self._release(ep)
      if budget_spent:
        return running + list(waiting)
      ready = self._ready(running)
      if not ready:
        if not in_flight and not waiting:
          return running
        if not in_flight and not (expert or self._free):
          raise RuntimeError("episodes wait for a sampler slot but none is free or "
                             "in use: an earlier call failed mid-rollout; make a new "
                             "RolloutEngine")
        continue
      ready = ready[:self.config.max_decode_batch]
      t0 = time.perf_counter()
      actions = (self._expert_actions(ready) if expert
                 else self._policy_actions(ready, stats))
      stats.generation += time.perf_counter() - t0
      batch = next(ticks)
      for ep, (ids, logprobs, reason) in zip(ready, actions):
        ep.segments.append(Segment(Role.ASSISTANT, ids, logprobs))
        ep.context_starts.append(ep.context_start)
        ep.stop_reasons.append(reason)
        ep.versions.append(self._version)
        ep.pending = None
        ep.batch = batch
        generated += len(ids)
        text = self.tok.decode(ids)
        in_flight[self._call(ep, ep.env.step, text, check=env_calls.checked_step)] = ep
      budget_spent = token_budget is not None and generated >= token_budget

  @staticmethod
  def _ready(running: list[_Episode]) -> list[_Episode]:
    """Episodes waiting for an action, longest-waiting first (cohorts stay whole)."""
    return sorted((ep for ep in running if not ep.done and ep.pending is not None),
                  key=lambda ep: ep.ready_at)

  def _gather(self, in_flight: dict[cf.Future, _Episode], num_ready: int) -> set:
    """The env calls to collect before the next decode.

    Blocks for the first call only when no episode is ready. Calls submitted
    together (one decode's actions, one round of resets) usually take about
    as long, so once one is back the rest of its batch gets up to
    `batch_wait_s` to join, while the decode batch has room; slow calls
    nobody has heard from are not waited for. Lockstep waits for them all.
    """
    if self.config.lockstep:
      return cf.wait(in_flight)[0]
    room = self.config.max_decode_batch or len(in_flight) + num_ready
    done = cf.wait(in_flight, timeout=None if num_ready == 0 else 0,
                   return_when=cf.FIRST_COMPLETED)[0]
    batches = {in_flight[f].batch for f in done}
    siblings = {f for f, ep in in_flight.items() if ep.batch in batches} - done
    deadline = time.perf_counter() + self.config.batch_wait_s
    while siblings and num_ready + len(done) < room:
      arrived, siblings = cf.wait(siblings, timeout=max(deadline - time.perf_counter(), 0),
                                  return_when=cf.FIRST_COMPLETED)
      if not arrived:
        break
      done |= arrived
    return done

  def _call(self, ep: _Episode, fn, *args, check=None, calls: int = 1) -> cf.Future:
    """Submits an env call of `ep` under its deadline (`calls` of them in a row)."""
    deadline = getattr(ep.env, "deadline_s", None) or self.config.env_deadline_s
    return self._calls.submit(_timed, ep, fn, *args, check=check,
                              deadline_s=None if deadline is None else deadline * calls)

  @staticmethod
  def _replay(ep: _Episode, task: Task) -> _Replayed:
    """Resets and replays the recorded actions (in the env's thread)."""
    observation, info = env_calls.checked_reset(ep.env.reset(task))
    return _Replayed(observation, info.get("state_key"),
                     [env_calls.checked_step(ep.env.step(a)) for a in ep.replay_actions])

  def _collect_replay(self, ep: _Episode, replayed: _Replayed) -> None:
    """Checks the replay reproduced the recording, then queues the prefix."""
    def mismatch(what):
      raise ValueError(
          f"task {ep.task.task_id}: replaying the recorded actions gave a different "
          f"{what}; branching needs an environment that replays exactly")
    prompt = self.fmt.prompt_ids(self.tok, self.system_prompt, replayed.observation,
                                 self.tools)
    if tuple(prompt) != ep.replay[0].token_ids:
      mismatch("prompt")
    ep.state_keys = [replayed.state_key]
    for k, result in enumerate(replayed.steps):
      action, recorded = ep.replay[1 + 2 * k], ep.replay[2 + 2 * k]
      ep.observation = self._clip_observation(result.observation)
      delta = self.fmt.observation_ids(self.tok, ep.observation, action.token_ids)
      if result.terminated or result.truncated or tuple(delta) != recorded.token_ids:
        mismatch(f"observation after turn {k}")
      if k < len(ep.rewards_check) and result.reward != ep.rewards_check[k]:
        mismatch(f"reward at turn {k}")
      _count_step(ep, result)
      ep.state_keys.append(result.info.get("state_key"))
    ep.segments = list(ep.replay)
    ep.context_starts = [ep.context_start] * len(replayed.steps)
    prefix = [t for s in ep.segments for t in s.token_ids]
    if ep.source is None:
      ep.pending, ep.fresh = prefix, True
    else:  # all but the last token forked; that one gives the next-token logits
      ep.fork = (ep.source.snapshot, len(prefix) - 1)
      ep.pending, ep.fresh = prefix[-1:], False

  def _collect(self, ep: _Episode, result) -> None:
    """An env call came back: queue its tokens or end the episode."""
    if isinstance(result, env_calls.Failure):
      ep.finish(result.reason, result.message)
      actions = sum(s.role == Role.ASSISTANT for s in ep.segments)
      ep.rewards += [0.0] * (actions - len(ep.rewards))  # the failed step paid nothing
      return
    if isinstance(result, _Replayed):
      self._collect_replay(ep, result)
      return
    if isinstance(result, tuple):  # reset -> (observation, info)
      ep.observation = result[0]
      ep.state_keys.append(result[1].get("state_key"))
      prompt = self.fmt.prompt_ids(self.tok, self.system_prompt, result[0], self.tools)
      ep.segments.append(Segment(Role.SYSTEM, prompt))
      if len(prompt) + 1 > self.max_context:  # no room for a single action
        ep.finish("context")
      else:
        ep.pending = prompt
      return
    _count_step(ep, result)
    if result.terminated:
      ep.finish("terminated")
      return
    ep.observation = self._clip_observation(result.observation)
    delta = self.fmt.observation_ids(self.tok, ep.observation,
                                     ep.segments[-1].token_ids)
    if result.truncated or len(ep.rewards) >= self.config.max_turns:
      # The state the budget cut the episode in: kept (never fed to the
      # sampler) so a truncated return bootstraps from a value read where the
      # value head is trained, after an observation and an assistant header.
      if ep.length + len(delta) <= self.max_context:
        ep.segments.append(Segment(Role.OBSERVATION, delta))
        if self.config.context_window is not None:
          self._slide_window(ep)  # the window the value is read in
          ep.context_starts.append(ep.context_start)
      ep.finish("env_truncated" if result.truncated else "max_turns")
      return
    ep.segments.append(Segment(Role.OBSERVATION, delta))
    ep.state_keys.append(result.info.get("state_key"))
    ep.pending = delta
    if self._slide_window(ep):
      # The slot restarts from the new window (its cached keys and positions
      # no longer match).
      ep.pending = [t for s in ep.context for t in s.token_ids]
      ep.fresh = True
    if ep.length + 1 > self.max_context:  # no room for another action
      ep.segments.pop()
      ep.finish("context")

  def _slide_window(self, ep: _Episode) -> bool:
    """Moves the window once an episode has more turns than it holds.

    The next action sees the prompt and the last k turns. Returns whether
    the window moved.
    """
    window = self.config.context_window
    if window is None or len(ep.rewards) <= window:
      return False
    actions = [i for i, s in enumerate(ep.segments) if s.role == Role.ASSISTANT]
    ep.context_start = actions[-window]
    return True

  def _clip_observation(self, observation: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """Each text cut to the token budget (a list of tool results: each result)."""
    if not isinstance(observation, str):
      return tuple(map(self._clip_observation, observation))
    text = observation
    budget = self.config.max_observation_tokens
    head = text[:budget * _CHARS_PER_TOKEN]
    ids = tok_lib.encode(self.tok, head)
    if len(ids) <= budget and len(head) == len(text):
      return text
    kept = self.tok.decode(ids[:budget])
    return kept + TRUNCATION_MARKER.format(len(text) - len(kept))

  def _keep_cache(self, ep: _Episode) -> None:
    """Snapshots a finished episode's cache before its slot is reused."""
    if ep.slot < 0 or ep.cached == 0:
      return
    ep.snapshot_id = next(self._snapshot_ids)
    tokens = [t for s in ep.segments for t in s.token_ids][:ep.cached]
    self._kept[ep.snapshot_id] = _Kept(
        self.sampler.snapshot(self._state, ep.slot, ep.cached), tokens, self._version)

  def _release(self, ep: _Episode) -> None:
    if self.sampler is not None and ep.slot >= 0:
      self._free.append(ep.slot)
    ep.slot = None
    self._call(ep, ep.env.close)  # not waited for; a hung close is abandoned

  def _policy_actions(self, ready: list[_Episode], stats: _Stats):
    sampler = self.sampler
    groups = {fresh: [ep for ep in ready if ep.fresh == fresh] for fresh in (True, False)}
    for fresh, feed in groups.items():
      for ep in feed:
        if ep.fork is not None:
          self._state = sampler.fork(self._state, ep.slot, *ep.fork)
          ep.fork = None
      if feed:
        call = sampler.prefill if fresh else sampler.extend
        self._state = call(self._state, [ep.slot for ep in feed],
                           [ep.pending for ep in feed])
        stats.fed_tokens += sum(len(ep.pending) for ep in feed)
      for ep in feed:
        ep.fresh = False
        ep.cached = ep.length
    room = [min(self.config.max_action_tokens, sampler.cache_length - ep.length)
            for ep in ready]
    cfg = self.config
    self._state, actions = sampler.decode(
        self._state, [ep.slot for ep in ready], stops=self.stops,
        max_new_tokens=room, temperature=self._temperature, top_k=cfg.top_k,
        top_p=cfg.top_p)
    stats.decode_calls += 1
    stats.occupancy += len(ready) / sampler.num_slots
    for ep in ready:
      ep.cached += len(actions[ep.slot].tokens)
      stats.generated_tokens += len(actions[ep.slot].tokens)
    return [(actions[ep.slot].tokens, actions[ep.slot].raw_logprobs,
             actions[ep.slot].stop_reason) for ep in ready]

  def _expert_actions(self, ready: list[_Episode]):
    """The experts' actions; one that ends on no stop string gets the
    format's end of turn, the token a policy must write to end it."""
    out, stops = [], (*self.stop_strings, *self.fmt.stops)
    closing = self.fmt.end_of_turn or (self.fmt.stops[0] if self.fmt.stops else "")
    for ep in ready:
      text = ep.expert(ep.observation)
      if not text.endswith(stops):
        text += closing
      out.append((tok_lib.encode(self.tok, text), None, STOP_SEQUENCE))
    return out

  def _success(self, ep: _Episode) -> bool:
    """It terminated and its last step said `info["success"]` (envs.contract)."""
    if ep.terminated and ep.success is None and not self._warned_success:
      self._warned_success = True
      warnings.warn(f"environment {self.env_name} ended an episode without "
                    "info['success']: its episodes count as failures (see "
                    "agentrl_jax.envs.contract)", stacklevel=2)
    return bool(ep.terminated and ep.success)

  @staticmethod
  def _failure(ep: _Episode) -> dict:
    return {"task_id": ep.task.task_id, "group_id": ep.group,
            "stop_reason": ep.stop_reason, "env_error": ep.error}

  def _record(self, ep: _Episode) -> Trajectory:
    n = sum(s.role == Role.ASSISTANT for s in ep.segments)
    return Trajectory(
        segments=ep.segments, reward=float(sum(ep.rewards)),
        turn_rewards=list(ep.rewards), terminated=ep.terminated,
        truncated=ep.truncated,
        context_starts=(None if self.config.context_window is None
                        else list(ep.context_starts)),
        metadata={
            "task_id": ep.task.task_id, "level": ep.task.level,
            "group_id": ep.group, "n_turns": len(ep.rewards),
            "tool_calls": ep.tool_calls, "tool_errors": ep.tool_errors,
            "stop_reasons": ep.stop_reasons, "policy_versions": ep.versions,
            "reward_parts": dict(ep.parts), "turn_reward_parts": list(ep.turn_parts),
            "env_time": ep.env_time,
            "stop_reason": ep.stop_reason, "env_error": ep.error,
            # Policy versions between the oldest turn and the update it feeds.
            "staleness": (self._version - min(ep.versions)) if ep.versions else 0,
            "success": self._success(ep),
            # The state each action was taken in (GiGPO's anchors); None
            # where the environment reports no key.
            "state_keys": (ep.state_keys + [None] * n)[:n],
            # Its kept cache (`keep_caches`), for `branch` to fork from.
            **({} if ep.snapshot_id is None else {"snapshot_id": ep.snapshot_id}),
        })


def _timed(ep: _Episode, fn, *args):
  """Runs an env call (on a worker), adding its seconds to the episode's."""
  t0 = time.perf_counter()
  try:
    return fn(*args)
  finally:
    ep.env_time += time.perf_counter() - t0


def _count_step(ep: _Episode, result: StepResult) -> None:
  """Adds a step's reward, reward parts and tool counters to its episode."""
  ep.rewards.append(result.reward)
  ep.parts.update(result.info.get("reward_parts", {}))
  ep.turn_parts.append(dict(result.info.get("reward_parts", {})))
  ep.tool_calls += bool(result.info.get("tool_call"))
  ep.tool_errors += bool(result.info.get("tool_error"))
  ep.success = result.info.get("success")


@dataclasses.dataclass
class _Replayed:
  observation: str  # the reset observation
  state_key: Any  # the reset state's info["state_key"] (None without one)
  steps: list[StepResult]  # what each replayed action returned


@dataclasses.dataclass
class _Kept:
  snapshot: Any  # sampling.SlotSnapshot of the episode's cache
  tokens: list[int]  # the tokens it holds
  version: int | None  # the policy version that computed them


@dataclasses.dataclass
class _Stats:
  num_slots: int
  abandoned: int = 0  # the engine's count of abandoned calls when the call began
  env_wait: float = 0.0
  generation: float = 0.0
  fed_tokens: int = 0  # prompt and observation tokens the sampler computed
  generated_tokens: int = 0
  decode_calls: int = 0
  occupancy: float = 0.0

  def summary(self, trajs: list[Trajectory], failed: list[dict],
              latencies: list[float], abandoned: int) -> dict[str, float]:
    """The call's metrics; `ended/<reason>` counts episodes (failed ones
    included) per stop reason, `env_call_*_s` are per env call, and
    `env_calls_abandoned` counts the calls this run abandoned."""
    n = max(len(trajs), 1)
    turns = [t.metadata["n_turns"] for t in trajs] or [0]
    stale = [t.metadata["staleness"] for t in trajs] or [0]
    calls = sum(t.metadata["tool_calls"] for t in trajs)
    reasons = collections.Counter(
        [t.metadata["stop_reason"] for t in trajs] + [f["stop_reason"] for f in failed])
    p50, p95, top = (np.percentile(latencies, [50, 95, 100]) if latencies
                     else (0.0, 0.0, 0.0))
    return {
        "episodes": float(len(trajs)),
        "turns_mean": float(np.mean(turns)), "turns_max": float(np.max(turns)),
        "action_tokens_mean": float(np.mean(
            [sum(len(s) for s in t.segments if s.role == Role.ASSISTANT)
             for t in trajs] or [0])),
        "terminated_frac": sum(t.terminated for t in trajs) / n,
        "truncated_frac": sum(t.truncated for t in trajs) / n,
        "success_frac": sum(t.metadata["success"] for t in trajs) / n,
        "reward_mean": float(np.mean([t.reward for t in trajs] or [0.0])),
        "tool_calls_per_turn": calls / max(sum(turns), 1),
        "tool_error_rate": sum(t.metadata["tool_errors"] for t in trajs) / max(calls, 1),
        "staleness_mean": float(np.mean(stale)), "staleness_max": float(np.max(stale)),
        **{f"ended/{r}": float(reasons[r]) for r in STOP_REASONS},
        "env_call_p50_s": float(p50), "env_call_p95_s": float(p95),
        "env_call_max_s": float(top), "env_calls_abandoned": float(abandoned),
        "env_wait_s": self.env_wait, "generation_s": self.generation,
        "sampler_fed_tokens": float(self.fed_tokens),
        "slot_occupancy": self.occupancy / max(self.decode_calls, 1),
    }
