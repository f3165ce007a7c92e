"""Tools from Python functions, called with JSON as instruct models write it.

    @tools.tool
    def stock(warehouse: str) -> int:
      '''Units in stock at a warehouse.

      Args:
        warehouse: The warehouse's code, e.g. "W17".
      '''
      ...

    stock.schema        # {"type": "function", "function": {"name": "stock", ...}}
    tools.render_call("stock", {"warehouse": "W17"})   # what the model writes
    calls = tools.parse_tool_calls(action_text)
    results = tools.run_calls(calls, {"stock": stock}, timeout_s=5.0)

- Schemas come from type hints and a Google-style docstring through
  `transformers.utils.get_json_schema`: the dicts a chat template renders
  when it is handed the function itself.
- `parse_tool_calls` reads Hermes/Qwen calls, `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`, outside `<think>` blocks, in linear time.
  A call it cannot read is a `CallError`, never an exception.
- `run_calls` checks each call's arguments against its tool's schema
  (missing, unexpected, wrongly typed, not in the enum), runs the valid ones
  concurrently under a per-call deadline (sync or async functions, on the
  daemon workers of `env_calls.EnvCaller`: a hung tool is abandoned, never
  joined) and returns one `CallResult` per call in call order. Exceptions,
  timeouts and oversized results become result texts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import threading
from typing import Any, Callable, Mapping, Sequence

from agentrl_jax import env_calls
from agentrl_jax.envs.base import strip_think

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
          "array": (list,), "object": (dict,), "null": (type(None),)}


@dataclasses.dataclass(frozen=True)
class Tool:
  """A function the model may call. `schema` is the OpenAI-style dict,
  `{"type": "function", "function": {"name", "description", "parameters"}}`."""

  fn: Callable[..., Any]
  schema: dict

  @property
  def name(self) -> str:
    return self.schema["function"]["name"]

  @property
  def parameters(self) -> dict:
    return self.schema["function"].get("parameters", {"type": "object", "properties": {}})

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)

  def check_arguments(self, arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit the schema, or None if they do."""
    params = self.parameters
    properties = params.get("properties", {})
    missing = [k for k in params.get("required", ()) if k not in arguments]
    if missing:
      return f"missing required argument(s) {', '.join(missing)}"
    unexpected = [k for k in arguments if k not in properties]
    if unexpected:
      return (f"unexpected argument(s) {', '.join(map(str, unexpected))[:200]}; "
              f"{self.name} takes {', '.join(properties) or 'no arguments'}")
    for key, value in arguments.items():
      problem = _mismatch(value, properties[key])
      if problem:
        return f"argument {key!r}: {problem}"
    return None


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None):
  """A `Tool` from a function with type hints and a Google-style docstring
  (usable as `@tool` or `@tool(name="...")`); raises if transformers cannot
  build its schema (a parameter without a type hint or description)."""
  if fn is None:
    return lambda f: tool(f, name=name)
  from transformers.utils import get_json_schema  # pylint: disable=import-outside-toplevel
  schema = get_json_schema(fn)
  if name is not None:
    schema = {**schema, "function": {**schema["function"], "name": name}}
  return Tool(fn, schema)


def as_tool(obj: Tool | Callable[..., Any]) -> Tool:
  return obj if isinstance(obj, Tool) else tool(obj)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A call as the model wrote it: a tool name and a JSON object of arguments."""
  name: str
  arguments: dict


@dataclasses.dataclass(frozen=True)
class CallError:
  """A `<tool_call>` block that is not a readable call: why, and its text."""
  message: str
  text: str


def parse_tool_calls(text: str) -> list[ToolCall | CallError]:
  """Every `<tool_call>...</tool_call>` block of `text` outside `<think>`
  blocks, in order. Each body must be a JSON object with a string "name"
  and an object "arguments" (absent: no arguments); a block left open, a
  body that is not JSON, a missing name or arguments that are not an object
  is a `CallError`. Linear time: `str.find` scans and one `json.loads` per
  block, no backtracking regex over the model's unbounded output."""
  text = strip_think(text)
  out: list[ToolCall | CallError] = []
  pos = 0
  while (start := text.find(CALL_OPEN, pos)) >= 0:
    body_start = start + len(CALL_OPEN)
    end = text.find(CALL_CLOSE, body_start)
    if end < 0:
      out.append(CallError(f"{CALL_OPEN} was not closed with {CALL_CLOSE}",
                           text[start:start + 200]))
      break
    out.append(_parse_body(text[body_start:end]))
    pos = end + len(CALL_CLOSE)
  return out


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
  """A call written as Qwen2.5's chat template writes an assistant's call
  (what a scripted expert should write, so SFT teaches the model's own form)."""
  call = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
  return f"{CALL_OPEN}\n{call}\n{CALL_CLOSE}"


def _parse_body(body: str) -> ToolCall | CallError:
  short = body.strip()[:200]
  try:
    call = json.loads(body)
  except (ValueError, RecursionError) as e:
    return CallError(f"the call is not valid JSON ({str(e)[:120]})", short)
  if not isinstance(call, dict):
    return CallError('a call must be a JSON object {"name": ..., "arguments": {...}}', short)
  name, arguments = call.get("name"), call.get("arguments", {})
  if not isinstance(name, str):
    return CallError('the call has no "name" string', short)
  if not isinstance(arguments, dict):
    return CallError(f'"arguments" must be a JSON object, not {_json_type(arguments)}', short)
  return ToolCall(name, arguments)


@dataclasses.dataclass(frozen=True)
class CallResult:
  """What one call gave back: the text the model reads, and whether the
  call failed (unreadable, unknown tool, bad arguments, exception, timeout)."""
  text: str
  ok: bool
  truncated: bool = False


def run_calls(calls: Sequence[ToolCall | CallError], tools: Mapping[str, Tool], *,
              timeout_s: float = 5.0, max_result_chars: int = 4000,
              max_calls: int = 8) -> list[CallResult]:
  """Runs `calls` (from `parse_tool_calls`) concurrently; results in call order.

  Each valid call runs at most `timeout_s` seconds; calls past the first
  `max_calls` fail without running. A result that is not a str is sent as
  JSON (or `str()` if it has no JSON form); one over `max_result_chars` is
  cut, with a marker saying how much was cut.
  """
  pending: dict[int, Any] = {}
  out: list[CallResult | None] = [None] * len(calls)
  for i, call in enumerate(calls):
    if i >= max_calls:
      out[i] = CallResult(f"Error: at most {max_calls} tool calls per turn; this one did "
                          "not run.", False)
    elif isinstance(call, CallError):
      out[i] = CallResult(f"Error: {call.message}.", False)
    elif call.name not in tools:
      out[i] = CallResult(f"Error: unknown tool {call.name[:60]!r}. Available tools: "
                          f"{', '.join(tools) or 'none'}.", False)
    elif (problem := tools[call.name].check_arguments(call.arguments)) is not None:
      out[i] = CallResult(f"Error: {call.name}: {problem}.", False)
    else:
      fn = tools[call.name].fn
      # Sync code inside a coroutine can block past wait_for: the worker's
      # deadline is the backstop.
      pending[i] = _caller().submit(_invoke, fn, call.arguments, timeout_s,
                                    deadline_s=timeout_s * 1.5 + 0.1)
  for i, future in pending.items():
    value = future.result()
    if isinstance(value, env_calls.Failure) or isinstance(value, _Timeout):
      reason = (f"did not finish within {timeout_s:g} s"
                if isinstance(value, _Timeout) or value.reason == env_calls.ENV_TIMEOUT
                else f"raised {value.message}")
      out[i] = CallResult(f"Error: {calls[i].name} {reason}.", False)
    else:
      out[i] = _result(value, max_result_chars)
  return out


class _Timeout:
  """An async tool cancelled at its deadline."""


def _invoke(fn: Callable[..., Any], arguments: dict, timeout_s: float):
  if inspect.iscoroutinefunction(fn):
    try:
      return asyncio.run(asyncio.wait_for(fn(**arguments), timeout_s))
    except asyncio.TimeoutError:
      return _Timeout()
  return fn(**arguments)


def _result(value: Any, max_chars: int) -> CallResult:
  if not isinstance(value, str):
    try:
      value = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
      value = str(value)
  if len(value) <= max_chars:
    return CallResult(value, True)
  return CallResult(f"{value[:max_chars]} ...[truncated {len(value) - max_chars} characters]",
                    True, truncated=True)


def _mismatch(value: Any, schema: Mapping[str, Any]) -> str | None:
  """Why `value` does not fit the JSON-schema subset get_json_schema writes
  (type or a list of types, nullable, enum, items, prefixItems, nested
  object properties), or None."""
  if value is None and schema.get("nullable"):
    return None
  if "anyOf" in schema:
    if all(_mismatch(value, s) for s in schema["anyOf"]):
      return f"{_json_type(value)} fits none of its allowed forms"
    return None
  kinds = schema.get("type")
  if kinds is not None:
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if not any(_is(value, k) for k in kinds):
      return f"expected {' or '.join(kinds)}, got {_json_type(value)}"
  if "enum" in schema and value not in schema["enum"]:
    return f"{json.dumps(value)[:60]} is not one of {schema['enum']}"
  if isinstance(value, list):
    if "prefixItems" in schema:
      items = schema["prefixItems"]
      if len(value) != len(items):
        return f"expected {len(items)} items, got {len(value)}"
      pairs = zip(value, items)
    else:
      pairs = ((v, schema.get("items", {})) for v in value)
    for k, (v, s) in enumerate(pairs):
      if (problem := _mismatch(v, s)) is not None:
        return f"item {k}: {problem}"
  if isinstance(value, dict) and "properties" in schema:
    nested = Tool(lambda: None, {"function": {"name": "object", "parameters": schema}})
    return nested.check_arguments(value)
  return None


def _is(value: Any, kind: str) -> bool:
  if kind not in _TYPES:
    return True  # a type get_json_schema does not write ("any"): accept
  if kind in ("integer", "number") and isinstance(value, bool):
    return False  # JSON true is not a number
  return isinstance(value, _TYPES[kind])


def _json_type(value: Any) -> str:
  for kind in ("null", "boolean", "integer", "number", "string", "array", "object"):
    if _is(value, kind):
      return kind
  return type(value).__name__


_CALLER: env_calls.EnvCaller | None = None
_CALLER_LOCK = threading.Lock()


def _caller() -> env_calls.EnvCaller:
  """The process's tool workers (shared by every episode's environment, so
  an environment per episode costs no threads of its own)."""
  global _CALLER  # pylint: disable=global-statement
  with _CALLER_LOCK:
    if _CALLER is None:
      _CALLER = env_calls.EnvCaller(32)
    return _CALLER
