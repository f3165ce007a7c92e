"""Adapters between our text-environment contract and its neighbours.

- `TurnBudget(env, max_turns)`: truncates (never terminates) an episode
  once the turn budget is spent.
- `SeedStyle(env)`: wraps an environment in the reference text's seed style,
  `reset(task) -> str` and `step(action) -> (observation, reward, done)`.
- `as_gymnasium(env, tasks)`: a real `gymnasium.Env` with `Text` spaces that
  passes `gymnasium.utils.env_checker.check_env`.
- `FromGymnasium(gym_env)`: the reverse, for an existing text-based
  gymnasium environment (or any, given an observation renderer and an
  action parser).

Every adapter keeps "errors are observations": an exception from the
wrapped environment becomes an observation, not a crash.
"""

from __future__ import annotations

import string
import traceback
from typing import Any, Callable, Sequence

import gymnasium
import numpy as np

from agentrl_jax.envs.base import EPISODE_OVER, Environment, StepResult, Task

_CHARSET = frozenset(string.printable)


def _error_result(e: Exception) -> StepResult:
  return StepResult(
      observation=f"Error: {type(e).__name__}: {e}", reward=0.0,
      terminated=False, truncated=False,
      info={"tool_error": True, "traceback": traceback.format_exc(limit=3)})


class TurnBudget:
  """Truncates an episode after `max_turns` steps unless it terminated."""

  def __init__(self, env: Environment, max_turns: int):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    self.env, self.max_turns, self.turns = env, max_turns, 0
    self.ended: tuple[bool, bool] | None = None  # (terminated, truncated) once over

  def __getattr__(self, name):  # system_prompt, stop_strings, tasks, ...
    return getattr(self.env, name)

  def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
    self.turns, self.ended = 0, None
    return self.env.reset(task)

  def step(self, action: str) -> StepResult:
    if self.ended is not None:  # terminal means terminal (see base.py)
      return StepResult(EPISODE_OVER, 0.0, *self.ended,
                        {"after_end": True, "turns": self.turns})
    result = self.env.step(action)
    self.turns += 1
    out_of_turns = not result.terminated and self.turns >= self.max_turns
    out = StepResult(result.observation, result.reward, result.terminated,
                     result.truncated or out_of_turns, {**result.info, "turns": self.turns})
    if out.terminated or out.truncated:
      self.ended = (out.terminated, out.truncated)
    return out

  def close(self) -> None:
    self.env.close()


class SeedStyle:
  """Adapts `reset(task) -> str`, `step(a) -> (obs, reward, done)` envs.

  `done` means the environment ended the episode, so it maps to
  `terminated`; wrap in `TurnBudget` to get truncation.
  """

  def __init__(self, env, *, system_prompt: str = "", stop_strings: Sequence[str] = ()):
    self.env = env
    self.system_prompt, self.stop_strings = system_prompt, tuple(stop_strings)

  def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
    return self.env.reset(task), {}

  def step(self, action: str) -> StepResult:
    try:
      observation, reward, done = self.env.step(action)
    except Exception as e:  # pylint: disable=broad-except
      return _error_result(e)
    # Success (envs.contract): ended with a positive reward.
    return StepResult(str(observation), float(reward), bool(done), False,
                      {"success": bool(done) and float(reward) > 0})

  def close(self) -> None:
    getattr(self.env, "close", lambda: None)()


class _GymnasiumText(gymnasium.Env):
  """A text environment as a gymnasium.Env (see `as_gymnasium`)."""

  metadata = {"render_modes": []}

  def __init__(self, env: Environment, tasks: Sequence[Task], max_length: int):
    if not tasks:
      raise ValueError("as_gymnasium needs at least one task to reset into")
    self.env, self.tasks, self.max_length = env, list(tasks), max_length
    self.observation_space = gymnasium.spaces.Text(max_length, charset="".join(sorted(_CHARSET)))
    self.action_space = gymnasium.spaces.Text(max_length, charset="".join(sorted(_CHARSET)))

  def _fit(self, text: str, info: dict) -> str:
    """Observations must lie in the Text space: non-printable characters
    become '?' and overlong text is cut; the original goes to info."""
    clean = "".join(c if c in _CHARSET else "?" for c in text)[:self.max_length]
    if clean != text:
      info["raw_observation"] = text
    return clean

  def reset(self, *, seed: int | None = None, options: dict | None = None):
    super().reset(seed=seed)
    if options and "task" in options:
      task = options["task"]
    else:
      task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
    observation, info = self.env.reset(task)
    info = dict(info)
    return self._fit(observation, info), info

  def step(self, action: str):
    result = self.env.step(action)
    info = dict(result.info)
    return (self._fit(result.observation, info), float(result.reward),
            result.terminated, result.truncated, info)

  def close(self):
    self.env.close()


def as_gymnasium(env: Environment, tasks: Sequence[Task], *,
                 max_length: int = 8192) -> gymnasium.Env:
  """A `gymnasium.Env` over `env`; `reset(seed=...)` draws one of `tasks`
  (or `options={"task": task}` picks one)."""
  return _GymnasiumText(env, tasks, max_length)


class FromGymnasium:
  """Wraps a gymnasium env as our Environment.

  `render` maps its observations to text (default `str`), `parse` maps
  action text to its actions (default identity, for text envs). A parse
  error is an observation. The task's `data` may hold `seed` and `options`
  for `gym_env.reset`.
  """

  def __init__(self, gym_env: gymnasium.Env,
               render: Callable[[Any], str] = str,
               parse: Callable[[str], Any] = lambda a: a):
    self.gym_env, self.render, self.parse = gym_env, render, parse

  def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
    obs, info = self.gym_env.reset(seed=task.data.get("seed"),
                                   options=task.data.get("options"))
    return self.render(obs), dict(info)

  def step(self, action: str) -> StepResult:
    try:
      obs, reward, terminated, truncated, info = self.gym_env.step(self.parse(action))
    except Exception as e:  # pylint: disable=broad-except
      return _error_result(e)
    reward = float(np.asarray(reward))
    return StepResult(self.render(obs), reward, bool(terminated), bool(truncated),
                      {"success": bool(terminated) and reward > 0, **info})

  def close(self) -> None:
    self.gym_env.close()
