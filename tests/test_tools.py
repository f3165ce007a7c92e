"""agentrl_jax.tools and envs.ToolEnv: schemas, parsing, calls, the environment."""

import asyncio
import json
import threading
import time
from typing import Literal, Optional

import hypothesis
from hypothesis import strategies as st
import pytest

from agentrl_jax import envs, tools
from agentrl_jax.envs import Task


def lookup(city: str, unit: Literal["km", "mi"] = "km", tags: Optional[list[str]] = None,
           limit: Optional[int] = None) -> int:
  """The distance to a city.

  Args:
    city: The city's name.
    unit: Kilometres or miles.
    tags: Labels to filter by.
    limit: At most this many results.
  """
  return {"Oslo": 1000, "Rome": 2000}[city]


def test_schema_from_type_hints_and_docstring():
  t = tools.tool(lookup)
  assert t.name == "lookup" and t(city="Oslo") == 1000
  # What transformers renders for this function in a chat template.
  assert t.schema == {"type": "function", "function": {
      "name": "lookup", "description": "The distance to a city.",
      "parameters": {"type": "object", "properties": {
          "city": {"type": "string", "description": "The city's name."},
          "unit": {"type": "string", "enum": ["km", "mi"],
                   "description": "Kilometres or miles."},
          "tags": {"type": "array", "items": {"type": "string"}, "nullable": True,
                   "description": "Labels to filter by."},
          "limit": {"type": "integer", "nullable": True,
                    "description": "At most this many results."}},
          "required": ["city"]},
      "return": {"type": "integer"}}}
  assert tools.tool(name="distance")(lookup).name == "distance"
  assert tools.as_tool(t) is t


def test_a_function_transformers_cannot_describe_is_refused():
  def bare(x: int):
    """No Args section."""

  def unhinted(x):
    """Doc.

    Args:
      x: A number.
    """
  with pytest.raises(Exception, match="no description for the argument 'x'"):
    tools.tool(bare)
  with pytest.raises(Exception, match="Argument x is missing a type hint"):
    tools.tool(unhinted)


@pytest.mark.parametrize("arguments, problem", [
    ({}, "missing required argument(s) city"),
    ({"city": "Oslo", "speed": 3},
     "unexpected argument(s) speed; lookup takes city, unit, tags, limit"),
    ({"city": 7}, "argument 'city': expected string, got integer"),
    ({"city": "Oslo", "limit": 2.5}, "argument 'limit': expected integer, got number"),
    ({"city": "Oslo", "limit": True}, "argument 'limit': expected integer, got boolean"),
    ({"city": "Oslo", "unit": "ft"}, "argument 'unit': \"ft\" is not one of ['km', 'mi']"),
    ({"city": "Oslo", "tags": ["a", 1]}, "argument 'tags': item 1: expected string, got integer"),
    ({"city": "Oslo", "tags": "a"}, "argument 'tags': expected array, got string"),
    ({"city": None}, "argument 'city': expected string, got null"),
])
def test_arguments_are_checked_against_the_schema(arguments, problem):
  assert tools.tool(lookup).check_arguments(arguments) == problem


def test_valid_arguments_pass():
  t = tools.tool(lookup)
  for arguments in ({"city": "Oslo"}, {"city": "Oslo", "unit": "mi", "tags": [], "limit": 3},
                    {"city": "Oslo", "tags": None, "limit": None}):
    assert t.check_arguments(arguments) is None


def _call(name, **arguments):
  return tools.render_call(name, arguments)


def test_parse_two_calls_in_order_outside_think():
  text = ("<think>" + _call("lookup", city="Rome") + "</think>Let me check. "
          + _call("lookup", city="Oslo") + "\n" + _call("other") + "<|im_end|>")
  assert tools.parse_tool_calls(text) == [tools.ToolCall("lookup", {"city": "Oslo"}),
                                          tools.ToolCall("other", {})]
  assert tools.parse_tool_calls("The answer is 3.") == []
  assert tools.render_call("f", {"x": "é"}) == '<tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call>'


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{\"name\": \"lookup\", </tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ("<tool_call>{\"arguments\": {}}</tool_call>", 'no "name" string'),
    ("<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
     '"arguments" must be a JSON object, not array'),
    ("<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>",
     '"arguments" must be a JSON object, not string'),
    ("<tool_call>{\"name\": \"f\"", "was not closed"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "not valid JSON"),
])
def test_unreadable_calls_are_errors_not_exceptions(text, message):
  (error,) = tools.parse_tool_calls(text)
  assert isinstance(error, tools.CallError) and message in error.message


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(
    ["<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", "\"name\"", ":",
     "\"f\"", ",", "\"arguments\"", "[", "]", "1", " ", "\n", "é", "<", ">"]),
    max_size=20).map("".join))
def test_parse_never_raises_and_matches_the_blocks(text):
  out = tools.parse_tool_calls(text)
  visible = envs.strip_think(text)
  closed = 0
  pos = 0
  while (start := visible.find("<tool_call>", pos)) >= 0:
    end = visible.find("</tool_call>", start + 11)
    if end < 0:
      break
    closed, pos = closed + 1, end + 12
  assert sum(not isinstance(c, tools.CallError) or "not closed" not in c.message
             for c in out) == closed


@pytest.mark.parametrize("unit", ["<tool_call>", "<tool_call>{", "<think>", "</tool_call>",
                                  "<tool_call>{}</tool_call>"])
def test_parsing_hostile_text_is_linear(unit):
  hostile = unit * (2**20 // len(unit))  # 1 MB
  t0 = time.thread_time()  # this thread's CPU time: holds on a loaded machine
  tools.parse_tool_calls(hostile)
  tools.parse_tool_calls("<think>" + hostile)
  assert time.thread_time() - t0 < 2.0  # linear: ~0.1 s; quadratic: hours


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(
    ["<tool_call>", "</tool_call>", "<think>", "</think>", '{"name": "lookup"', '"big"',
     ', "arguments": ', '{"city": "Oslo"}', '{"n": 5}', "}", "[", "null", "é", "\n",
     "<|im_end|>"]), max_size=12).map("".join))
def test_tool_env_steps_never_raise(action):
  env = _env()
  env.reset(TASK)
  result = env.step(action)
  assert isinstance(result.observation, (str, list)) and isinstance(result.reward, float)
  if not result.terminated:  # a turn with calls: one result each, in order
    assert len(result.observation) == len(tools.parse_tool_calls(action))


def _env(**kwargs):
  def fail(x: int) -> int:
    """Divides by zero.

    Args:
      x: A number.
    """
    return x // 0

  def hang(seconds: float) -> str:
    """Sleeps.

    Args:
      seconds: How long.
    """
    time.sleep(seconds)
    return "woke"

  def big(n: int) -> str:
    """A long text.

    Args:
      n: Its length.
    """
    return "x" * n

  return envs.ToolEnv(tools=[lookup, fail, hang, big],
                      reward_fn=lambda task, answer: float(answer == task.data["answer"]),
                      format_penalty=0.5, timeout_s=0.3, max_result_chars=100, **kwargs)


TASK = Task("t0", "How far is Oslo?", {"answer": "1000"})


@pytest.mark.parametrize("action, error", [
    ("<tool_call>{\"name\": \"lookup\"</tool_call>", "not valid JSON"),
    (_call("teleport", city="Oslo"), "unknown tool 'teleport'. Available tools: lookup, fail, "
                                     "hang, big."),
    ("<tool_call>{\"name\": \"lookup\", \"arguments\": [\"Oslo\"]}</tool_call>",
     '"arguments" must be a JSON object'),
    (_call("lookup"), "lookup: missing required argument(s) city."),
    (_call("lookup", city="Oslo", speed=1), "unexpected argument(s) speed"),
    (_call("lookup", city=3), "argument 'city': expected string, got integer"),
    (_call("lookup", city="Oslo", unit="ft"), "is not one of ['km', 'mi']"),
    (_call("lookup", city="Paris"), "lookup raised KeyError: 'Paris'"),
    (_call("fail", x=1), "fail raised ZeroDivisionError"),
    (_call("hang", seconds=30), "hang did not finish within 0.3 s"),
    ("<tool_call>{\"name\": \"lookup\"", "was not closed"),
])
def test_every_bad_call_is_an_observation_with_the_penalty(action, error):
  env = _env()
  env.reset(TASK)
  t0 = time.monotonic()
  result = env.step(action)
  assert time.monotonic() - t0 < 10  # the hung tool ended at its deadline, not after 30 s
  (text,) = result.observation
  assert text.startswith("Error: ") and error in text, text
  assert not result.terminated and result.info["tool_error"]
  assert result.info["reward_parts"]["format"] == -0.5 and result.reward == -0.5


def test_two_calls_run_concurrently_and_answer_in_call_order():
  barrier = threading.Barrier(2, timeout=20)

  def wait_a(x: str) -> str:
    """Waits for the other call.

    Args:
      x: Echoed.
    """
    barrier.wait()  # both calls must run at once to get past this
    return f"a:{x}"

  async def wait_b(x: str) -> str:
    """Waits for the other call, asynchronously.

    Args:
      x: Echoed.
    """
    await asyncio.to_thread(barrier.wait)
    return f"b:{x}"

  env = envs.ToolEnv(tools=[wait_a, wait_b], reward_fn=lambda t, a: 0.0, call_cost=0.1)
  env.reset(TASK)
  result = env.step(_call("wait_b", x="1") + "\n" + _call("wait_a", x="2") + "<|im_end|>")
  assert result.observation == ["b:1", "a:2"]
  assert result.info["reward_parts"]["cost"] == pytest.approx(-0.2)
  assert result.info["reward_parts"]["format"] == 0.0 and not result.info["tool_error"]


def test_an_async_tool_that_hangs_is_cancelled_at_its_deadline():
  async def stall() -> str:
    """Never answers."""
    await asyncio.sleep(60)
    return "late"

  results = tools.run_calls([tools.ToolCall("stall", {})], {"stall": tools.tool(stall)},
                            timeout_s=0.2)
  assert results == [tools.CallResult("Error: stall did not finish within 0.2 s.", False)]


def test_results_are_json_cut_and_capped():
  env = _env(max_calls=2)
  env.reset(TASK)
  result = env.step(_call("big", n=250) + _call("lookup", city="Rome") + _call("lookup", city="Oslo"))
  long, rome, third = result.observation
  assert long == "x" * 100 + " ...[truncated 150 characters]"
  assert rome == "2000"
  assert third == "Error: at most 2 tool calls per turn; this one did not run."
  assert tools.run_calls([tools.ToolCall("f", {})], {"f": tools.Tool(
      lambda: {"a": [1, "é"]}, {"function": {"name": "f"}})}) == [
          tools.CallResult('{"a": [1, "é"]}', True)]


def test_a_turn_without_a_call_is_the_final_answer():
  env = _env()
  assert env.reset(TASK) == ("How far is Oslo?", {"task_id": "t0", "state_key": env.state_key("")})
  assert env.step(_call("lookup", city="Oslo")).observation == ["1000"]
  final = env.step("<think>Oslo is 1000.</think> 1000<|im_end|>")
  assert final.terminated and final.reward == 1.0 and final.info["success"]
  assert final.info["answer"] == "1000"
  assert env.step("again").observation == envs.EPISODE_OVER
  env.reset(TASK)
  wrong = env.step("900")
  assert wrong.terminated and wrong.reward == 0.0 and not wrong.info["success"]


def test_success_is_the_environments_own():
  env = envs.ToolEnv(tools=[lookup], reward_fn=lambda t, a: 0.3,
                     success_fn=lambda t, a: a == "yes")
  env.reset(TASK)
  assert env.step("no").info["success"] is False
  env.reset(TASK)
  r = env.step("yes")
  assert r.info["success"] is True and r.reward == pytest.approx(0.3)


def test_state_keys_are_the_calls_and_results_so_far():
  keys = []
  for calls in (["Oslo"], ["Oslo"], ["Rome"], ["Oslo", "Rome"]):
    env = _env()
    _, info = env.reset(TASK)
    start = info["state_key"]
    for city in calls:
      info = env.step(_call("lookup", city=city)).info
    keys.append(info["state_key"])
  assert keys[0] == keys[1] and len(set(keys)) == 3 and start not in keys


def test_tasks_from_jsonl_split_by_hash(tmp_path):
  path = tmp_path / "tasks.jsonl"
  rows = [{"id": f"q{i}", "prompt": f"Question {i}?", "answer": str(i)} for i in range(200)]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
  loaded = envs.load_tasks(path)
  assert loaded[3] == Task("q3", "Question 3?", {"answer": "3"})
  env = envs.ToolEnv(tools=[lookup], reward_fn=lambda t, a: 0.0, tasks=path)
  split = {s: {t.prompt for t in loaded if envs.base.hashed_split(t.prompt)[0] == s}
           for s in ("train", "test")}
  assert 0.1 < len(split["test"]) / 200 < 0.3  # ~1 in 5
  train = env.tasks("train", len(split["train"]), seed=0)
  assert {t.prompt for t in train} == split["train"]
  assert env.tasks("test", 5, seed=1) == env.tasks("test", 5, seed=1) != env.tasks("test", 5, 2)
  with pytest.raises(ValueError, match=f"only {len(split['test'])} test tasks"):
    env.tasks("test", 199, seed=0)


@pytest.mark.parametrize("lines, message", [
    (['{"id": 1, "prompt": "a"}', "{oops"], ":2: not JSON"),
    (['{"prompt": "a"}'], ':1: a task needs "id"'),
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], ":2: duplicate task id 'a'"),
])
def test_bad_task_files_name_their_line(tmp_path, lines, message):
  path = tmp_path / "tasks.jsonl"
  path.write_text("\n".join(lines))
  with pytest.raises(ValueError, match=message):
    envs.load_tasks(path)


def test_tool_env_refuses_duplicate_or_no_tools():
  with pytest.raises(ValueError, match="two tools are named 'lookup'"):
    envs.ToolEnv(tools=[lookup, lookup], reward_fn=lambda t, a: 0.0)
  with pytest.raises(ValueError, match="at least one tool"):
    envs.ToolEnv(tools=[], reward_fn=lambda t, a: 0.0)
