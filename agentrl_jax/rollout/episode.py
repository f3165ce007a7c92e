"""One episode's turn loop as a state machine: prompt, sample, step, observe.

An `Episode` waits for one environment call at a time, and the call's result
takes the transition the call was made for (`receive`): a reset gives the
prompt, a step its reward and the observation delta, a failure ends the
episode. In between it holds `pending`, the tokens the sampler takes in
before its next action; `act` records that action and makes the step call.
The episode never touches the sampler or the threads (`scheduler.py` does).

The transcript is what the sampler consumed and produced: SYSTEM = the
prompt delta, ASSISTANT = the sampled tokens (the stop's tokens included)
with their log-probs under the trained policy and under the distribution
they were drawn from, OBSERVATION = the observation delta (wrapper and
next assistant header included). A terminated episode ends on its last
action; a truncated one (turn budget, or the environment's truncation) ends
on the observation that followed it, the state its return bootstraps from
(docs/design.md, convention 4), unless that would overflow the context.
An observation may be a list of texts (one per tool call); each is cut by
characters before it is tokenized, so a huge one costs bounded work. The
reset observation is cut alike; a prompt that still leaves no room for
`min_action_tokens` ends the episode before it has a segment
("prompt_too_long").

Context policies: append-only (`context_window=None`) keeps every turn in
the cache, so each observation extends it by its own tokens. A sliding
window (`context_window=k`) keeps the prompt and the last k turns: once an
episode has more than k turns, the window moves every turn and the slot is
re-prefilled with prompt + window, a prefill of ~prompt + k turns instead of
an extend of one observation (see `benchmarks/rollout.py`). Each action's
window is recorded (`Trajectory.context_starts`) so training teacher-forces
it in the context it was sampled in (`Trajectory.flatten_views`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple

from agentrl_jax import env_calls
from agentrl_jax import tokenizer as tok_lib
from agentrl_jax.envs.base import Environment, StepResult, Task
from agentrl_jax.sampling import STOP_SEQUENCE
from agentrl_jax.trajectory import Role, Segment, Trajectory

TRUNCATION_MARKER = " ...[truncated {} characters]"
# Observations are cut to this many characters per token of budget before
# tokenizing (bounded work on a huge one); tokens are rarely this long.
_CHARS_PER_TOKEN = 32

# Why an episode ended (`metadata["stop_reason"]`): the task ended; the turn
# budget, the environment's truncation or the context ran out; the
# environment failed (see `env_calls`); its prompt left no room for an
# action (it has no tokens: `RolloutResult.failed`, never a trajectory).
PROMPT_TOO_LONG = "prompt_too_long"
STOP_REASONS = ("terminated", "max_turns", "env_truncated", "context",
                env_calls.ENV_TIMEOUT, env_calls.ENV_ERROR, PROMPT_TOO_LONG)


@dataclasses.dataclass(frozen=True, eq=False)
class TurnFormat:
  """How an engine's episodes turn text into tokens, and their budgets."""

  tok: Any  # the tokenizer
  fmt: tok_lib.ChatFormat
  system_prompt: str
  tools: tuple[dict, ...]  # JSON schemas rendered into the prompt
  stop_strings: tuple[str, ...]  # the environment's
  max_context: int  # tokens an episode may hold
  max_turns: int
  max_observation_tokens: int
  context_window: int | None  # turns kept besides the prompt; None: all
  min_action_tokens: int = 1  # room a prompt must leave in max_context

  def prompt_ids(self, observation: str) -> list[int]:
    return self.fmt.prompt_ids(self.tok, self.system_prompt, observation, self.tools)

  def observation_ids(self, observation: str | tuple[str, ...],
                      action: tuple[int, ...]) -> list[int]:
    """The observation's delta after `action` (its wrapper and the next header)."""
    return self.fmt.observation_ids(self.tok, observation, action)

  def clip_observation(self, observation: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """Each text cut to the token budget (a list of tool results: each result)."""
    if not isinstance(observation, str):
      return tuple(map(self.clip_observation, observation))
    budget = self.max_observation_tokens
    head = observation[:budget * _CHARS_PER_TOKEN]
    ids = tok_lib.encode(self.tok, head)
    if len(ids) <= budget and len(head) == len(observation):
      return observation
    kept = self.tok.decode(ids[:budget])
    return kept + TRUNCATION_MARKER.format(len(observation) - len(kept))


class Action(NamedTuple):
  """One turn's action, as the sampler (or an expert) wrote it."""
  token_ids: list[int]  # [n], the stop's tokens included
  logprobs: list[float] | None  # [n] the trained policy's; None for an expert's
  stop_reason: int  # sampling.STOP_*
  # [n] under the distribution drawn from (temperature, top-k, top-p); None:
  # the policy itself, or an expert's
  sampling_logprobs: list[float] | None = None


@dataclasses.dataclass(frozen=True)
class Feed:
  """Tokens the sampler takes into an episode's slot before its next action."""
  tokens: list[int]  # [n] token ids
  prefill: bool  # they start the slot's context (else they extend it)
  # (SlotSnapshot, length): copy that cached prefix into the slot first.
  fork: tuple[Any, int] | None = None


@dataclasses.dataclass(frozen=True)
class EnvCall:
  """An environment call to run in the threads (`count` calls in a row)."""
  fn: Callable
  args: tuple = ()
  check: Callable | None = None  # env_calls.checked_reset / checked_step
  count: int = 1  # the deadline scales with it


@dataclasses.dataclass
class StepTally:
  """What the environment's calls reported over an episode."""
  rewards: list[float] = dataclasses.field(default_factory=list)  # per step
  reward_parts: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)  # summed over steps
  turn_reward_parts: list[dict] = dataclasses.field(default_factory=list)  # per step
  tool_calls: int = 0
  tool_errors: int = 0
  malformed: int = 0  # steps whose action the environment could not parse
  success: bool | None = None  # the last step's info["success"]
  env_time: float = 0.0  # seconds in its env calls (added by the worker threads)

  def count(self, result: StepResult) -> None:
    """Adds a step's reward, reward parts and tool counters."""
    self.rewards.append(result.reward)
    self.reward_parts.update(result.info.get("reward_parts", {}))
    self.turn_reward_parts.append(dict(result.info.get("reward_parts", {})))
    self.tool_calls += bool(result.info.get("tool_call"))
    self.tool_errors += bool(result.info.get("tool_error"))
    self.malformed += bool(result.info.get("malformed"))
    self.success = result.info.get("success")


@dataclasses.dataclass(eq=False)
class Episode:
  """One episode: its transcript, where its turn loop stands, and its slot."""

  task: Task
  group: int
  env: Environment  # its own instance (group members never share one)
  turn_format: TurnFormat
  expert: Callable[[Any], str] | None = None  # expert mode: observation -> action text
  # The transcript (becomes the Trajectory).
  segments: list[Segment] = dataclasses.field(default_factory=list)
  context_start: int = 1  # segments[context_start:] follow the prompt in the cache
  context_starts: list[int] = dataclasses.field(default_factory=list)  # per action
  stop_reasons: list[int] = dataclasses.field(default_factory=list)  # per action
  versions: list[int] = dataclasses.field(default_factory=list)  # policy version per action
  state_keys: list = dataclasses.field(default_factory=list)  # info["state_key"] per state
  steps: StepTally = dataclasses.field(default_factory=StepTally)
  extra_metadata: dict = dataclasses.field(default_factory=dict)  # e.g. snapshot_id
  # The turn loop.
  pending: Feed | None = None  # set: it waits for an action
  observation: Any = ""  # the last one (the expert's input)
  awaiting: Callable[[Any], None] | None = None  # the in-flight call's transition
  stop_reason: str | None = None  # why it ended (`STOP_REASONS`); None: running
  error: str | None = None  # the env_error / env_timeout text
  # The scheduler's bookkeeping.
  slot: int | None = None  # -1: expert (no slot); None: not admitted, or released
  cached_tokens: int = 0  # tokens in the slot's cache
  queued_at: int = 0  # tick its last env call came back (longest-waiting first)
  submitted_in: int = 0  # the submission round of its env call (its cohort)

  @property
  def done(self) -> bool:
    return self.stop_reason is not None

  @property
  def terminated(self) -> bool:
    return self.stop_reason == "terminated"

  @property
  def truncated(self) -> bool:
    return self.done and not self.terminated

  @property
  def context(self) -> list[Segment]:
    """The segments in the slot's cache (once pending is fed): prompt + window."""
    return self.segments[:1] + self.segments[self.context_start:]

  @property
  def length(self) -> int:
    """Tokens in the slot's cache once pending is fed."""
    return sum(len(s) for s in self.context)

  @property
  def num_actions(self) -> int:
    return sum(s.role == Role.ASSISTANT for s in self.segments)

  def context_ids(self) -> list[int]:
    return [t for s in self.context for t in s.token_ids]

  def finish(self, reason: str, error: str | None = None) -> None:
    self.stop_reason, self.error = reason, error

  # -- Transitions ---------------------------------------------------------------

  def start(self) -> EnvCall:
    """The first call: reset on the task."""
    return self._call(self._on_reset, self.env.reset, self.task,
                      check=env_calls.checked_reset)

  def receive(self, result: Any) -> None:
    """The in-flight call came back: its own transition, or a failure's."""
    transition, self.awaiting = self.awaiting, None
    if isinstance(result, env_calls.Failure):
      self.finish(result.reason, result.message)
      self.steps.rewards += [0.0] * (self.num_actions - len(self.steps.rewards))
    else:
      transition(result)

  def act(self, action: Action, version: int | None) -> EnvCall:
    """Records the action sampled by policy `version`; the step call to make."""
    self.segments.append(Segment(Role.ASSISTANT, action.token_ids, action.logprobs,
                                 action.sampling_logprobs))
    self.context_starts.append(self.context_start)
    self.stop_reasons.append(action.stop_reason)
    self.versions.append(version)
    self.pending = None
    text = self.turn_format.tok.decode(action.token_ids)
    return self._call(self._on_step, self.env.step, text, check=env_calls.checked_step)

  def expert_action(self) -> Action:
    """The expert's action; one that ends on no stop string gets the format's
    end of turn, the token a policy must write to end it."""
    fmt = self.turn_format.fmt
    text = self.expert(self.observation)
    if not text.endswith((*self.turn_format.stop_strings, *fmt.stops)):
      text += fmt.end_of_turn or (fmt.stops[0] if fmt.stops else "")
    return Action(tok_lib.encode(self.turn_format.tok, text), None, STOP_SEQUENCE)

  def refeed(self) -> None:
    """Queues its whole context for prefill (the policy changed: the cached
    keys/values came from the old weights)."""
    if self.segments:  # (a pending observation is already a segment)
      self.pending = Feed(self.context_ids(), prefill=True)

  def _call(self, transition: Callable[[Any], None], fn: Callable, *args,
            check: Callable | None = None, count: int = 1) -> EnvCall:
    self.awaiting = transition
    return EnvCall(fn, args, check, count)

  def _on_reset(self, reset: tuple[str, dict]) -> None:
    observation, info = reset
    fmt = self.turn_format
    self.observation = fmt.clip_observation(observation)
    if self.observation != observation:  # the engine names such tasks
      self.extra_metadata["prompt_cut"] = True
    self.state_keys.append(info.get("state_key"))
    prompt = fmt.prompt_ids(self.observation)
    if len(prompt) + fmt.min_action_tokens > fmt.max_context:
      # Dropped whole (no segment): an episode without an action never
      # reaches a batch.
      self.finish(PROMPT_TOO_LONG, f"a prompt of {len(prompt)} tokens leaves no room for "
                  f"{fmt.min_action_tokens} action tokens in {fmt.max_context}")
      return
    self.segments.append(Segment(Role.SYSTEM, prompt))
    self.pending = Feed(prompt, prefill=True)

  def _on_step(self, result: StepResult) -> None:
    self.steps.count(result)
    if result.terminated:
      self.finish("terminated")
      return
    self.observation = self.turn_format.clip_observation(result.observation)
    delta = self.turn_format.observation_ids(self.observation,
                                             self.segments[-1].token_ids)
    if result.truncated or len(self.steps.rewards) >= self.turn_format.max_turns:
      # The state the budget cut the episode in: kept (never fed to the
      # sampler) so a truncated return bootstraps from a value read where the
      # value head is trained, after an observation and an assistant header.
      if self.length + len(delta) <= self.turn_format.max_context:
        self.segments.append(Segment(Role.OBSERVATION, delta))
        if self.turn_format.context_window is not None:
          self._slide_window()  # the window the value is read in
          self.context_starts.append(self.context_start)
      self.finish("env_truncated" if result.truncated else "max_turns")
      return
    self.segments.append(Segment(Role.OBSERVATION, delta))
    self.state_keys.append(result.info.get("state_key"))
    # A moved window restarts the slot (its cached keys and positions no
    # longer match).
    self.pending = (Feed(self.context_ids(), prefill=True) if self._slide_window()
                    else Feed(delta, prefill=False))
    if self.length + 1 > self.turn_format.max_context:  # no room for another action
      self.segments.pop()
      self.finish("context")

  def _slide_window(self) -> bool:
    """Moves the window once the episode has more turns than it holds, so the
    next action sees the prompt and the last k turns; whether it moved."""
    window = self.turn_format.context_window
    if window is None or len(self.steps.rewards) <= window:
      return False
    actions = [i for i, s in enumerate(self.segments) if s.role == Role.ASSISTANT]
    self.context_start = actions[-window]
    return True

  # -- The record ----------------------------------------------------------------

  def to_trajectory(self, version: int | None, success: bool) -> Trajectory:
    """The finished episode, recorded by a call of policy `version`."""
    steps, n = self.steps, self.num_actions
    return Trajectory(
        segments=self.segments, reward=float(sum(steps.rewards)),
        turn_rewards=list(steps.rewards), terminated=self.terminated,
        truncated=self.truncated,
        context_starts=(None if self.turn_format.context_window is None
                        else list(self.context_starts)),
        metadata={
            "task_id": self.task.task_id, "level": self.task.level,
            "group_id": self.group, "n_turns": len(steps.rewards),
            "tool_calls": steps.tool_calls, "tool_errors": steps.tool_errors,
            "malformed": steps.malformed,
            "stop_reasons": self.stop_reasons, "policy_versions": self.versions,
            "reward_parts": dict(steps.reward_parts),
            "turn_reward_parts": list(steps.turn_reward_parts),
            "env_time": steps.env_time,
            "stop_reason": self.stop_reason, "env_error": self.error,
            # Policy versions between the oldest turn and the update it feeds.
            "staleness": (version - min(self.versions)) if self.versions else 0,
            "success": success,
            # The state each action was taken in (GiGPO's anchors); None
            # where the environment reports no key.
            "state_keys": (self.state_keys + [None] * n)[:n],
            **self.extra_metadata,
        })

  def failure(self) -> dict:
    """An episode that failed before it had a prompt, for `RolloutResult.failed`."""
    return {"task_id": self.task.task_id, "group_id": self.group,
            "stop_reason": self.stop_reason, "env_error": self.error}
