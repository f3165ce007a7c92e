"""The environment contract: Gymnasium-style reset/step over text.

    observation, info = env.reset(task)
    result = env.step(action_text)   # StepResult(observation, reward,
                                     #            terminated, truncated, info)
    env.close()

- `terminated`: the task really ended (its return is final).
  `truncated`: a budget ran out first (its return is a lower bound). They are
  never merged (docs/design.md, convention 4).
- Errors are observations (convention 5): a malformed action, an unknown
  tool, a tool exception or timeout comes back as an observation saying so
  (with the configured format penalty); no exception escapes `step`.
  `TextEnvironment.step` enforces that for every bundled environment. A
  step that could not parse its action says so with `info["malformed"]`
  (the rollout's `malformed_turn_frac` counts them).
- Rewards are composed from named parts (`REWARD_PARTS`), reported in
  `info["reward_parts"]` every step; the step reward is their sum.
- Terminal means terminal: a step after `terminated` (or `truncated`)
  returns `EPISODE_OVER`, reward 0 and the same flag, and changes nothing.
- Isolation (convention 6): one instance per episode; `reset` must fully
  reset whatever state the instance holds.
- State keys: an environment that can tell when two episodes of one task
  stand in the same state reports a hashable `info["state_key"]` from
  `reset` and every `step` (equal keys: the same state). GiGPO groups the
  turns taken from one state (`TextEnvironment.state_key`); without a key a
  turn has no such group.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import math
import random
import re
import traceback
from typing import Any, Callable, Hashable, Protocol, Sequence, runtime_checkable

REWARD_PARTS = ("outcome", "format", "cost", "process")
EPISODE_OVER = "The episode is over."  # the observation of any step after the end
_OPEN = re.compile(r"<(\w+)>")
_CLOSE = re.compile(r"</(\w+)>")


def hashed_split(key: str) -> tuple[str, str]:
  """("train" | "test", sha256 hex of key): a stable ~80/20 split by content,
  so the splits stay disjoint whatever seed or n generated the tasks."""
  digest = hashlib.sha256(key.encode()).hexdigest()
  return ("test" if int(digest, 16) % 5 == 0 else "train"), digest


def hashed_draws(split: str, n: int, seed: int, draw: Callable[[random.Random], tuple[str, Any]]
                 ) -> list[tuple[str, str, Any]]:
  """`n` distinct problems of `split`: `draw(rng)` -> (text, payload) is
  called with a `random.Random(seed)` until `n` texts hash into `split`
  (`hashed_split`: about 1 in 5 is a test problem). Returns (text, sha256
  of the text, payload) triples; ValueError if `n` are not found."""
  rng = random.Random(seed)
  out, seen = [], set()
  for _ in range(100 * n + 1000):  # generous: each draw succeeds ~1 in 5
    if len(out) == n:
      return out
    text, payload = draw(rng)
    where, digest = hashed_split(text)
    if digest not in seen and where == split:
      seen.add(digest)
      out.append((text, digest, payload))
  if len(out) < n:
    raise ValueError(f"found only {len(out)} of {n} distinct {split} problems")
  return out


def strip_think(text: str) -> str:
  """`text` without its `<think>...</think>` blocks (each up to its first
  closing tag; an unclosed `<think>` stays). Linear time: `str.find` scans,
  no backtracking regex over the model's unbounded output."""
  out, pos = [], 0
  while (start := text.find("<think>", pos)) >= 0:
    end = text.find("</think>", start + 7)
    if end < 0:
      break
    out.append(text[pos:start])
    pos = end + 8
  out.append(text[pos:])
  return "".join(out)


def tool_call(action: str) -> tuple[str, str] | None:
  r"""(tag, raw body) of the first `<tag>body</tag>` outside <think> blocks.

  The first opening tag with a closing tag of its name after it; the body
  runs to the first such closing. Linear time: one pass records each name's
  last closing, one pass over the openings looks it up, so hostile text (a
  megabyte of unclosed or distinct tags) never meets the quadratic
  backtracking of `<(\w+)>(.*?)</\1>`.
  """
  text = strip_think(action)
  last_close = {match.group(1): match.start() for match in _CLOSE.finditer(text)}
  if last_close:
    for match in _OPEN.finditer(text):
      name, end = match.group(1), match.end()
      if last_close.get(name, -1) >= end:
        return name, text[end:text.find(f"</{name}>", end)]
  return None


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation: str | Sequence[str]  # a list: one result per tool call
  reward: float
  terminated: bool
  truncated: bool
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Task:
  """One task instance. `prompt` is what the agent is told; `data` holds what
  the environment needs to run and verify it (never shown to the agent)."""

  task_id: str
  prompt: str
  data: dict[str, Any] = dataclasses.field(default_factory=dict)
  level: int = 0  # difficulty, for curricula (e.g. 1-hop = 0, 2-hop = 1)


@runtime_checkable
class Environment(Protocol):

  def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
    ...

  def step(self, action: str) -> StepResult:
    ...

  def close(self) -> None:
    ...


class Expert(Protocol):
  """A scripted policy for one episode: the next action text given the last
  observation (the first call gets the reset observation)."""

  def __call__(self, observation: str) -> str:
    ...


def canonical_text(text: str) -> str:
  """`text` with its whitespace runs as single spaces: a state key made of
  what an observation says, not how it is laid out."""
  return " ".join(text.split())


def reward_parts(**parts: float) -> dict[str, float]:
  """A full parts dict (missing parts are 0); raises on unknown or non-finite."""
  unknown = set(parts) - set(REWARD_PARTS)
  if unknown:
    raise ValueError(f"unknown reward parts {sorted(unknown)}; known: {REWARD_PARTS}")
  out = {k: float(parts.get(k, 0.0)) for k in REWARD_PARTS}
  if not all(math.isfinite(v) for v in out.values()):
    raise ValueError(f"reward parts must be finite, got {out}")
  return out


class TextEnvironment(abc.ABC):
  """Base class of the bundled environments.

  Subclasses implement `_reset(task) -> observation` and
  `_step(action) -> (observation, parts: dict, terminated, info)`, and set
  `system_prompt` and `stop_strings` (the tool tags that end an action; the
  rollout adds them to the sampler's stops). This class turns any
  exception in `_step` into an observation with the format penalty, sums
  the reward parts, counts turns and reports `info["success"]` (terminated
  with a positive outcome part, unless `_step`'s info says otherwise).
  The full contract: `agentrl_jax.envs.contract`.

  Classmethods every bundled environment provides: `tasks(split, n, seed)`
  (splits "train" and "test" are disjoint) and `expert(task) -> Expert`.
  """

  system_prompt: str = ""
  stop_strings: tuple[str, ...] = ()
  tools: tuple[dict, ...] = ()  # JSON schemas the chat format renders

  def __init__(self, *, format_penalty: float = 0.0, step_cost: float = 0.0):
    self.format_penalty = format_penalty
    self.step_cost = step_cost
    self.task: Task | None = None
    self.turns = 0
    self.ended = False  # terminated: later steps get `EPISODE_OVER`

  def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
    self.task, self.turns, self.ended = task, 0, False
    observation = self._reset(task)
    return observation, self._with_key({"task_id": task.task_id}, observation)

  def step(self, action: str) -> StepResult:
    if self.task is None:
      raise RuntimeError("call reset(task) before step(action)")
    if self.ended:  # never pays the outcome again, never reopens
      return StepResult(EPISODE_OVER, 0.0, True, False, {
          "tool_call": False, "tool_error": False, "after_end": True,
          "reward_parts": reward_parts(), "turn": self.turns})
    self.turns += 1
    try:
      observation, parts, terminated, info = self._step(action)
    except Exception as e:  # pylint: disable=broad-except
      # Errors are observations: the episode goes on and the model learns
      # from the message; the traceback stays in info for debugging.
      observation = f"Error: {type(e).__name__}: {e}"
      parts, terminated = {"format": -self.format_penalty}, False
      info = {"tool_error": True, "traceback": traceback.format_exc(limit=3)}
    parts = dict(parts)
    parts["cost"] = parts.get("cost", 0.0) - self.step_cost
    parts = reward_parts(**parts)
    info = {"tool_call": False, "tool_error": False,
            "success": bool(terminated) and parts["outcome"] > 0, **info,
            "reward_parts": parts, "turn": self.turns}
    self.ended = bool(terminated)
    return StepResult(observation, sum(parts.values()), self.ended, False,
                      self._with_key(info, observation))

  def close(self) -> None:
    self.task = None

  def state_key(self, observation: str) -> Hashable | None:
    """A hashable key of the state the environment is in after returning
    `observation` (equal keys: the same state of the same task), or None
    when the environment cannot tell (the default)."""
    del observation
    return None

  def _with_key(self, info: dict[str, Any], observation: str) -> dict[str, Any]:
    key = self.state_key(observation)
    return info if key is None else {**info, "state_key": key}

  def reject(self, call: tuple[str, str] | None, tools: Sequence[str],
             usage: Sequence[str]) -> tuple[str, dict, bool, dict] | None:
    """The reply to a missing or unknown tool call (`tool_call` output), or
    None when `call` names one of `tools`."""
    if call is not None and call[0] in tools:
      return None
    observation, parts, done, info = self.malformed(usage)
    if call is not None:
      observation = f"Unknown tool <{call[0][:40]}>. {observation}"
    return observation, parts, done, info

  def malformed(self, expected: Sequence[str]) -> tuple[str, dict, bool, dict]:
    """The standard reply to an action with no recognised tool call."""
    return (f"Invalid action. Use one of: {', '.join(expected)}.",
            {"format": -self.format_penalty}, False, {"malformed": True})

  @abc.abstractmethod
  def _reset(self, task: Task) -> str:
    """Resets all episode state; returns the task observation."""

  @abc.abstractmethod
  def _step(self, action: str) -> tuple[str, dict[str, float], bool, dict[str, Any]]:
    """Returns (observation, reward parts, terminated, info)."""
