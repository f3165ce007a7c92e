"""ToolEnv: a task answered with the help of Python functions called as JSON.

    env = envs.ToolEnv(tools=[stock, price], reward_fn=exact_number,
                       tasks="tasks.jsonl", expert=my_expert)

Each turn the model either calls tools, as instruct models do
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per
turn; `agentrl_jax.tools`), and reads their results (a list of strings, one
per call, which the chat format renders as consecutive `<tool_response>`
blocks), or writes an assistant turn with no call: the final answer. That
ends the episode, scored by `reward_fn(task, answer)` (the outcome part).
A call that cannot run (unreadable, unknown tool, bad arguments, an
exception, past its deadline) costs the format penalty once per turn;
`call_cost` is charged per call (the cost part). Success is
`success_fn(task, answer)`, by default a positive outcome. The state key
(for GiGPO) is the calls and results so far.

Tasks load from a JSONL file (`load_tasks`: one object per line with "id",
"prompt" and whatever the reward needs), split 80/20 by a hash of the
prompt, as the bundled environments split theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
from typing import Any, Callable, Sequence

from agentrl_jax import tools as tools_lib
from agentrl_jax.envs.base import Expert, Task, TextEnvironment, hashed_split, strip_think

SPLITS = ("train", "test")
# End-of-turn tokens a decoded action may end with: not part of the answer.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")
DEFAULT_SYSTEM_PROMPT = ("Use the tools when you need them. When you know the answer, "
                         "reply with the answer alone, without a tool call.")


def load_tasks(path: str | os.PathLike) -> list[Task]:
  """Tasks from a JSONL file: per line an object with "id" (unique), "prompt"
  and any other fields (they become `Task.data`; an integer "level" becomes
  `Task.level`). Blank lines are skipped; a bad line raises naming it."""
  out, seen = [], set()
  for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except ValueError as e:
      raise ValueError(f"{path}:{number}: not JSON ({e})") from None
    if not (isinstance(row, dict) and isinstance(row.get("prompt"), str)
            and isinstance(row.get("id"), (str, int))):
      raise ValueError(f'{path}:{number}: a task needs "id" (str or int) and "prompt" (str)')
    data = dict(row)
    task_id, prompt = str(data.pop("id")), data.pop("prompt")
    if task_id in seen:
      raise ValueError(f"{path}:{number}: duplicate task id {task_id!r}")
    seen.add(task_id)
    out.append(Task(task_id, prompt, data, int(data.pop("level", 0))))
  return out


class ToolEnv(TextEnvironment):
  """Tools as JSON calls, a final answer scored by `reward_fn`.

  Args:
    tools: functions (their schemas from type hints and docstrings) or
      `agentrl_jax.tools.Tool`s.
    reward_fn: (task, answer text) -> float, the outcome part.
    tasks: a JSONL path (`load_tasks`) or a list of `Task`s, split by hash;
      or a function (split, n, seed, **task_kwargs) -> tasks that splits
      them itself; None for an environment that only steps (the trainer
      needs tasks).
    expert: task -> Expert (observation -> action text), the scripted policy
      for SFT; None: none.
    success_fn: (task, answer) -> bool; default: the outcome is positive.
    system_prompt: the system turn's text (the chat format adds the tools).
    format_penalty: charged once per turn with a call that could not run.
    call_cost: charged per tool call.
    timeout_s, max_result_chars, max_calls: per-call deadline, result size
      and calls per turn (`tools.run_calls`).
    stop_strings: () lets a turn hold several calls (it ends at the chat
      format's end of turn); ("</tool_call>",) ends it at the first call.
  """

  def __init__(self, tools: Sequence[tools_lib.Tool | Callable[..., Any]],
               reward_fn: Callable[[Task, str], float], *,
               tasks: str | os.PathLike | Sequence[Task] | Callable[..., list[Task]]
               | None = None,
               expert: Callable[[Task], Expert] | None = None,
               success_fn: Callable[[Task, str], bool] | None = None,
               system_prompt: str = DEFAULT_SYSTEM_PROMPT, format_penalty: float = 0.1,
               call_cost: float = 0.0, timeout_s: float = 5.0,
               max_result_chars: int = 4000, max_calls: int = 8,
               stop_strings: Sequence[str] = ()):
    super().__init__(format_penalty=format_penalty)
    self._tools = {}
    for t in map(tools_lib.as_tool, tools):
      if t.name in self._tools:
        raise ValueError(f"two tools are named {t.name!r}")
      self._tools[t.name] = t
    if not self._tools:
      raise ValueError("a ToolEnv needs at least one tool")
    self.tools = tuple(t.schema for t in self._tools.values())
    self.reward_fn, self.success_fn = reward_fn, success_fn
    self.expert = expert  # None: no expert (the contract's optional piece)
    self.system_prompt = system_prompt
    self.stop_strings = tuple(stop_strings)
    self.call_cost, self.timeout_s = call_cost, timeout_s
    self.max_result_chars, self.max_calls = max_result_chars, max_calls
    self._task_source = tasks
    self._history: list = []

  def tasks(self, split: str, n: int, seed: int, **task_kwargs) -> list[Task]:
    """`n` tasks of `split`, in a seeded order; raises if it has fewer."""
    if self._task_source is None:
      raise ValueError("this ToolEnv was built without tasks (pass tasks=path or a list)")
    if callable(self._task_source):
      return self._task_source(split, n, seed, **task_kwargs)
    if task_kwargs:
      raise ValueError(f"tasks from a file or list take no task_kwargs, got {task_kwargs}")
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    pool = (load_tasks(self._task_source)
            if isinstance(self._task_source, (str, os.PathLike)) else list(self._task_source))
    pool = [t for t in pool if hashed_split(t.prompt)[0] == split]
    if len(pool) < n:
      raise ValueError(f"only {len(pool)} {split} tasks (of {n} asked for); lower "
                       f"env.num_{'train' if split == 'train' else 'eval'}_tasks or add tasks")
    random.Random(seed).shuffle(pool)
    return pool[:n]

  def _reset(self, task: Task) -> str:
    self._history = []
    return task.prompt

  def state_key(self, observation: str) -> str:
    """A digest of the calls and results so far (the same calls with the
    same results: the same state)."""
    del observation
    return hashlib.sha256(json.dumps(self._history, sort_keys=True).encode()).hexdigest()[:16]

  def _step(self, action: str):
    text = _without_end_marker(action)
    calls = tools_lib.parse_tool_calls(text)
    if not calls:
      answer = strip_think(text).strip()
      outcome = float(self.reward_fn(self.task, answer))
      success = (bool(self.success_fn(self.task, answer)) if self.success_fn is not None
                 else outcome > 0)
      return ("", {"outcome": outcome}, True, {"success": success, "answer": answer})
    results = tools_lib.run_calls(calls, self._tools, timeout_s=self.timeout_s,
                                  max_result_chars=self.max_result_chars,
                                  max_calls=self.max_calls)
    failed = sum(not r.ok for r in results)
    self._history.append([[_describe(c), r.text] for c, r in zip(calls, results)])
    parts = {"format": -self.format_penalty if failed else 0.0,
             "cost": -self.call_cost * len(calls)}
    return ([r.text for r in results], parts, False,
            {"tool_call": True, "tool_error": failed > 0, "calls": len(calls),
             "failed_calls": failed, "malformed": any(
                 isinstance(c, tools_lib.CallError) for c in calls)})


def _without_end_marker(action: str) -> str:
  for marker in END_OF_TURN_MARKERS:
    if action.endswith(marker):
      return action[:-len(marker)]
  return action


def _describe(call) -> Any:
  if isinstance(call, tools_lib.CallError):
    return ["error", call.text]
  return [call.name, call.arguments]
