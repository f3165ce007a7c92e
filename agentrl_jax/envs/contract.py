"""What the engine and the trainer need of an environment, checked at once.

An environment is an object with these members (a class or a factory
function returning a fresh one per episode; `TextEnvironment` and `ToolEnv`
have them all):

  reset(task) -> (observation, info)     Gymnasium-style (see base.py)
  step(action) -> StepResult
  close()
  system_prompt: str                     the system turn's text
  stop_strings: tuple[str, ...]          strings that end an action besides
                                         the chat format's end of turn; ()
                                         when the end of turn alone does
  tools: tuple[dict, ...]                JSON schemas the chat format renders
                                         into the system turn (optional, ())
  tasks(split, n, seed, **kw) -> [Task]  "train" / "test", disjoint (the
                                         trainer's; optional for the engine)
  expert(task) -> Expert | None          a scripted policy for SFT (optional;
                                         None: no expert, `sft.steps=0`)

Success: the step that ends an episode reports `info["success"]` (a bool);
an episode succeeds when it terminated and its last step said so.
`TextEnvironment` fills it in for subclasses that do not (terminated with a
positive outcome part).

`check(env)` reads these from an instance and raises `ContractError` naming
what to add; `RolloutEngine` checks what it needs when it is built and
`train_agent` the rest before any work starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class ContractError(TypeError):
  """An environment lacks something the engine or the trainer needs."""


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """What an environment declares (read from one instance)."""
  name: str
  system_prompt: str
  stop_strings: tuple[str, ...]
  tools: tuple[dict, ...]
  has_tasks: bool
  has_expert: bool


def check(env: Any, *, need_tasks: bool = False, need_expert: bool = False) -> EnvSpec:
  """The spec of `env`, or ContractError listing every missing piece."""
  name = type(env).__name__
  problems = []
  for method in ("reset", "step", "close"):
    if not callable(getattr(env, method, None)):
      problems.append(f"a method {method}() (see agentrl_jax.envs.base)")
  system_prompt = getattr(env, "system_prompt", None)
  if not isinstance(system_prompt, str):
    problems.append('system_prompt = "..." (a str: the system turn\'s text; "" for none)')
  stops = getattr(env, "stop_strings", None)
  if not (isinstance(stops, (tuple, list)) and all(isinstance(s, str) and s for s in stops)):
    problems.append("stop_strings = (...) (non-empty strs that end an action, e.g. a "
                    "closing tool tag; () when the chat format's end of turn alone ends "
                    "one)")
  tools = getattr(env, "tools", ())
  if not (isinstance(tools, (tuple, list)) and all(_is_schema(t) for t in tools)):
    problems.append('tools = (schema, ...) of {"type": "function", "function": {"name": '
                    '...}} dicts (agentrl_jax.tools.tool(fn).schema), or ()')
  has_tasks = callable(getattr(env, "tasks", None))
  if need_tasks and not has_tasks:
    problems.append("a method tasks(split, n, seed, **task_kwargs) -> list[Task] "
                    "(splits 'train' and 'test', disjoint)")
  has_expert = callable(getattr(env, "expert", None))
  if need_expert and not has_expert:
    problems.append("a method expert(task) -> Expert for the SFT warm start (or run "
                    "with --config.sft.steps=0)")
  if problems:
    raise ContractError(f"environment {name} needs: " + "; ".join(problems))
  return EnvSpec(name, system_prompt, tuple(stops), tuple(tools), has_tasks, has_expert)


def _is_schema(t: Any) -> bool:
  return (isinstance(t, dict) and isinstance(t.get("function"), dict)
          and isinstance(t["function"].get("name"), str))
