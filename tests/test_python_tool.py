"""PythonToolEnv: tasks, the expert, hidden tests, errors as observations."""

import ast
import collections
import dataclasses
import json
import math
import re

import pytest

from conftest import assert_stays_over

from agentrl_jax.envs.python_tool import _KINDS, NUM_CASES, PythonToolEnv
from agentrl_jax.envs.sandbox import Sandbox

FAST = Sandbox(cpu_seconds=1, wall_seconds=2, memory_mb=128, output_bytes=1024)


def play(env, task, actions):
  """The StepResults of `actions` (a list, or an expert) until termination."""
  obs, _ = env.reset(task)
  results = []
  for i in range(10):
    action = actions(obs) if callable(actions) else actions[i]
    results.append(env.step(action))
    obs = results[-1].observation
    if results[-1].terminated or (not callable(actions) and i + 1 == len(actions)):
      break
  return results


@pytest.fixture(scope="module")
def task():
  return PythonToolEnv.tasks("test", 1, 0)[0]


def test_tasks_deterministic_distinct_and_split():
  a, b = PythonToolEnv.tasks("train", 30, 0), PythonToolEnv.tasks("train", 30, 0)
  assert a == b and a != PythonToolEnv.tasks("train", 30, 1)
  assert len({t.task_id for t in a}) == 30
  train, test = PythonToolEnv.tasks("train", 200, 0), PythonToolEnv.tasks("test", 200, 0)
  assert not {t.prompt for t in train} & {t.prompt for t in test}
  assert {t.data["kind"] for t in train} == set(_KINDS)
  assert all(len(t.data["tests"]) == NUM_CASES for t in train)
  with pytest.raises(ValueError, match="known"):
    PythonToolEnv.tasks("validation", 1, 0)


def test_expected_outputs_match_independent_oracles():
  """Hidden expected values of three kinds, recomputed another way."""
  checked = collections.Counter()
  for t in PythonToolEnv.tasks("train", 300, 0):
    numbers = [int(x) for x in re.findall(r"\d+", t.prompt)]
    for args_json, want in t.data["tests"]:
      (arg,) = json.loads(args_json)
      if t.data["kind"] == "sum_multiples":  # inclusion-exclusion
        a, b = numbers[-2:]
        lcm = a * b // math.gcd(a, b)
        tri = lambda k: k * (arg // k) * (arg // k + 1) // 2
        got = tri(a) + tri(b) - tri(lcm)
      elif t.data["kind"] == "caesar":  # str.translate
        k = numbers[0] * (1 if "forward" in t.prompt else -1)
        abc = "abcdefghijklmnopqrstuvwxyz"
        got = arg.translate(str.maketrans(abc, abc[k % 26:] + abc[:k % 26]))
      elif t.data["kind"] == "palindrome":
        ignore = re.search(r"characters ('.*?'|\".*?\") are removed", t.prompt).group(1)
        kept = "".join(c for c in arg.lower() if c not in ast.literal_eval(ignore))
        got = kept == kept[::-1]
      else:
        continue
      assert json.dumps(got) == want, (t.prompt, arg)
      checked[t.data["kind"]] += 1
  assert len(checked) == 3


def test_expert_solves_test_tasks_and_one_of_each_kind():
  tasks = PythonToolEnv.tasks("test", 10, 0)
  by_kind = {t.data["kind"]: t for t in PythonToolEnv.tasks("train", 100, 0)}
  for t in tasks + list(by_kind.values()):
    results = play(PythonToolEnv(sandbox=FAST), t, PythonToolEnv.expert(t))
    assert [r.info["tool_call"] for r in results] == [True, True], t.task_id
    assert results[0].observation.startswith("stdout:\n") and not results[0].terminated
    assert results[-1].terminated and results[-1].reward == 1.0, (t.prompt, results[-1])
    assert results[-1].observation == f"All {NUM_CASES} hidden tests passed."


def test_terminal_means_terminal(task):
  env = PythonToolEnv(sandbox=FAST)
  results = play(env, task, PythonToolEnv.expert(task))
  assert results[-1].terminated and results[-1].reward == 1.0
  submit = f"<submit>{task.data['solution']}</submit>"
  assert_stays_over(env, [submit, "<python>print(1)</python>", "garbage"])


def test_wrong_and_partly_right_submissions(task):
  [wrong] = play(PythonToolEnv(sandbox=FAST), task, ["<submit>def solve(*args): return None</submit>"])
  assert wrong.terminated and wrong.reward == 0.0 and wrong.info["passed"] == 0
  assert "0/8 hidden tests passed. First failure: solve(" in wrong.observation
  assert wrong.observation.endswith("returned null.")
  # The reference, except that it raises on the first hidden input: 1 in 8 fails.
  first = json.loads(task.data["tests"][0][0])
  code = (task.data["solution"] + "_reference = solve\n"
          f"def solve(*args):\n  if list(args) == {first!r}:\n    raise ValueError('nope')\n"
          "  return _reference(*args)\n")
  passed = sum(json.loads(a) != first for a, _ in task.data["tests"])
  env = PythonToolEnv(sandbox=FAST, partial_credit=0.5)
  [part] = play(env, task, [f"<submit>{code}</submit>"])
  assert part.info["passed"] == passed < NUM_CASES and part.terminated
  assert part.info["reward_parts"]["outcome"] == 0.0
  assert part.info["reward_parts"]["process"] == pytest.approx(0.5 * passed / NUM_CASES)
  assert "raised ValueError: nope." in part.observation


def test_time_limits_become_observations(task):
  # A wall limit far above the CPU limit: on a starved CPU the busy loop
  # still reaches its CPU second first.
  env = PythonToolEnv(sandbox=dataclasses.replace(FAST, wall_seconds=30))
  loop, submitted = play(env, task, ["<python>while True: pass</python>",
                                     "<submit>def solve(*a):\n  while True: pass</submit>"])
  assert loop.observation.startswith("Timed out: cpu time limit") and not loop.terminated
  assert loop.info["tool_error"]
  assert submitted.terminated and submitted.reward == 0.0
  assert submitted.observation.startswith("0/8 hidden tests passed. Timed out: cpu time limit")


def test_code_errors_and_output(task):
  env = PythonToolEnv(sandbox=FAST)
  crash, fenced, syntax, missing = play(env, task, [
      "Let me try.\n<python>print('hi')\n1/0</python>",
      "<think>maybe <submit>x</submit></think><python>\n```python\nprint(3)\n```\n</python>",
      "<python>def f(:</python>",
      "<submit>def answer(x): return x</submit>"])
  assert crash.observation.startswith("Exit code 1.\nstdout:\nhi\nstderr:\nTraceback")
  assert crash.observation.endswith("ZeroDivisionError: division by zero")
  assert fenced.observation == "stdout:\n3" and not fenced.info["tool_error"]
  assert "SyntaxError" in syntax.observation and not syntax.terminated
  assert missing.terminated and "does not define a function solve" in missing.observation


def test_malformed_actions_are_observations(task):
  env = PythonToolEnv(sandbox=FAST, format_penalty=0.1)
  plain, unknown, empty = play(env, task, ["just text", "<calc>1+1</calc>", "<python>  </python>"])
  assert plain.observation.startswith("Invalid action. Use one of: <python>")
  assert unknown.observation.startswith("Unknown tool <calc>.")
  assert empty.observation == "Error: empty <python> block."
  for r in (plain, unknown, empty):
    assert not r.terminated and r.reward == pytest.approx(-0.1)
