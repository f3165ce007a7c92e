"""The arithmetic environment: the exact evaluator, problems, splits, the expert
through the real env and through the rollout engine in Qwen2.5's format."""

import re
from fractions import Fraction

import pytest

from agentrl_jax import envs, tools
from agentrl_jax import tokenizer as T
from agentrl_jax.envs import arithmetic as A
from agentrl_jax.envs.base import REWARD_PARTS, hashed_split
from agentrl_jax.envs.calculator import CalcError
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax.trajectory import Role


def play(env, task, policy, max_turns=10):
  """The StepResults of one episode through reset/step."""
  obs, _ = env.reset(task)
  results = []
  for _ in range(max_turns):
    results.append(env.step(policy(obs)))
    obs = results[-1].observation
    if results[-1].terminated:
      break
  return results


def call(expression):
  return tools.render_call("calculate", {"expression": expression})


def decoded(traj, role, tokenizer):
  return [tokenizer.decode(s.token_ids) for s in traj.segments if s.role == role]


# ---------------------------------------------------------------- the evaluator

@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 14),                # * before +
    ("(2 + 3) * 4", 20),
    ("10 - 4 - 3", 3),                # left to right: (10 - 4) - 3
    ("100 / 10 / 5", 2),              # (100 / 10) / 5
    ("2 * (3 + 4) - 5 * (6 - 8)", 24),  # 14 - (-10)
    ("-3 * -4", 12),
    ("-(2 - 5) + +1", 4),
    ("7 / 2", Fraction(7, 2)),
    ("0.1 + 0.2", Fraction(3, 10)),   # exact: floats give 0.30000000000000004
    ("1 / 3 * 3", 1),
    ("2.50 * 4", 10),
    (".5 + 12.", Fraction(25, 2)),
    ("  ((7))  ", 7),
    ("1000000000000000", 10**15),     # MAX_ABS itself is allowed
])
def test_evaluate_values(expression, value):
  result = A.evaluate(expression)
  assert isinstance(result, Fraction) and result == value


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "not 'x'"),
    ("abs(-3)", "not 'abs(-3)'"),
    ("(1).real", "not '(1).real'"),
    ("__import__('os').system('true')", "allowed"),
    ("2 ** 8", "not '2 ** 8'"),
    ("99 ** 99 ** 99", "allowed"),
    ("7 // 2", "allowed"),
    ("7 % 2", "allowed"),
    ("1 if 1 else 2", "allowed"),
    ("[1]", "allowed"),
    ("'12'", "allowed"),
    ("True + 1", "not 'True'"),
    ("3j", "allowed"),
    ("1e999999999", "plain decimals, not '1e999999999'"),  # Fraction would build 10**1e9
    ("1_000", "plain decimals"),
    ("0x10", "plain decimals"),
    ("1 / 0", "division by zero"),
    ("5 / (3 - 3)", "division by zero"),
    ("2 +", "invalid expression"),
    ("", "invalid expression"),
    ("1\x00", "invalid expression"),
    ("1000000000000001", "past 1e+15"),         # a literal past MAX_ABS
    ("99999999 * 99999999", "past 1e+15"),      # a product past it
    ("1 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7 / 7",
     "denominator"),                              # 7**18 > 1e15
    ("9" * 201, "longer than 200"),
])
def test_evaluate_rejects(expression, message):
  with pytest.raises(CalcError, match=re.escape(message)):  # a substring of the message
    A.evaluate(expression)


def test_calculate_writes_whole_numbers_and_fractions_that_read_back():
  assert A.calculate("84 / 2") == "42"
  assert A.calculate("-14 / 4") == "-7/2"  # reduced
  third = A.calculate("1 / 3")
  assert third == "1/3" and A.calculate(f"{third} * 3") == "1"


# ---------------------------------------------------------------- problems

def test_problems_by_hand():
  [two] = A.tasks("train", 1, 0, operations=(2,))
  assert two.prompt == ("A van drives 45 km every day for 28 days, then 998 km more to "
                        "return to its depot. How many km does it drive in total?")
  # 45 * 28 = 1260; 1260 + 998 = 2258
  assert two.data == {"answer": 2258, "steps": ("45 * 28", "1260 + 998"),
                      "expression": "45 * 28 + 998"}
  [three] = A.tasks("train", 1, 0, operations=(3,))
  assert three.prompt == (
      "A farm picks 374 kg of apples in each of its 19 orchards and packs them in bags "
      "of 11 kg. It keeps 507 bags. How many bags does it sell?")
  # 374 * 19 = 7480 - 374 = 7106 kg; 7106 / 11 = 646 bags (11 * 646 = 7106); 646 - 507 = 139
  assert three.data == {"answer": 139, "steps": ("374 * 19", "7106 / 11", "646 - 507"),
                        "expression": "374 * 19 / 11 - 507"}
  [four] = A.tasks("train", 1, 0, operations=(4,))
  assert four.prompt == (
      "Ben buys 33 books at 87 dollars each and 39 scarves at 28 dollars each, and pays "
      "with 4200 dollars. How many dollars of change does Ben get?")
  # 33 * 87 = 2640 + 231 = 2871; 39 * 28 = 1120 - 28 = 1092; 2871 + 1092 = 3963;
  # 4200 - 3963 = 237. The sum is bracketed in the one-line form.
  assert four.data == {"answer": 237, "steps": ("33 * 87", "39 * 28", "2871 + 1092",
                                                "4200 - 3963"),
                       "expression": "4200 - (33 * 87 + 39 * 28)"}
  assert (two.level, three.level, four.level) == (0, 1, 2)


def test_problems_are_well_formed_and_seeded():
  tasks = A.tasks("train", 1000, 0)
  assert tasks == A.tasks("train", 1000, 0) and tasks != A.tasks("train", 1000, 1)
  assert len({t.prompt for t in tasks}) == 1000
  assert {t.level for t in tasks} == {0, 1, 2}
  assert len({re.sub(r"\d+", "N", t.prompt) for t in tasks}) >= 11  # every setting drawn
  for t in tasks:
    numbers = re.findall(r"\d+", t.prompt)
    assert all(2 <= len(n) <= 4 and n[0] != "0" for n in numbers), t.prompt
    steps, answer = t.data["steps"], t.data["answer"]
    assert len(steps) == t.level + 2
    # Each step is "a op b" of plain numbers whose result is a positive integer,
    # and the last one's result is the answer, as is the one-line expression's.
    values = [A.evaluate(s) for s in steps]
    assert all(re.fullmatch(r"\d+ [-+*/] \d+", s) for s in steps)
    assert all(v.denominator == 1 and v > 0 for v in values)
    assert values[-1] == answer == A.evaluate(t.data["expression"])
    assert t.task_id == f"arith/{hashed_split(t.prompt)[1][:16]}"


def test_splits_are_disjoint_by_problem():
  train, test = A.tasks("train", 400, 0), A.tasks("test", 200, 0)
  assert not {t.prompt for t in train} & {t.prompt for t in test}
  assert all(hashed_split(t.prompt)[0] == "test" for t in test)
  # Another seed draws other problems, never one of the other split's.
  assert not {t.prompt for t in A.tasks("train", 400, 7)} & {t.prompt for t in test}
  with pytest.raises(ValueError, match="known"):
    A.tasks("validation", 1, 0)
  with pytest.raises(ValueError, match="unknown operations \\[5\\]"):
    A.tasks("train", 1, 0, operations=(5,))


# ---------------------------------------------------------------- the environment

def test_declares_the_contract_and_is_registered():
  env = envs.make("arithmetic")
  spec = envs.check(env, need_tasks=True, need_expert=True)
  assert spec.system_prompt == A.SYSTEM_PROMPT and spec.stop_strings == ()
  [schema] = spec.tools
  assert schema["function"]["name"] == "calculate"
  assert schema["function"]["parameters"]["required"] == ["expression"]
  assert env.tasks("test", 5, 3) == A.tasks("test", 5, 3)
  assert env.tasks("train", 2, 0, operations=(4,)) == A.tasks("train", 2, 0, operations=(4,))


def test_without_the_tool_one_turn_answers_the_same_problems():
  env = envs.make("arithmetic", with_tool=False)
  spec = envs.check(env, need_tasks=True)
  assert spec.tools == () and spec.system_prompt == A.NO_TOOL_SYSTEM_PROMPT
  assert env.tasks("test", 5, 3) == A.tasks("test", 5, 3)
  task = A.tasks("train", 1, 0)[0]
  for answer, reward in ((str(task.data["answer"]), 1.0), (str(task.data["answer"] + 1), 0.0),
                         (A.tools_lib.render_call("calculate", {"expression": "1 + 1"}), 0.0)):
    assert env.reset(task)[0] == task.prompt
    result = env.step(answer)
    assert result.terminated and result.reward == reward
    assert result.info["success"] == (reward == 1.0)


def test_the_expert_solves_every_task_through_the_env():
  for task in A.tasks("train", 100, 0) + A.tasks("test", 100, 0):
    env = envs.make("arithmetic")
    results = play(env, task, env.expert(task))
    *calls, last = results
    assert last.terminated and last.reward == 1.0 and last.info["success"], task
    assert len(calls) == task.level + 2
    assert [r.observation for r in calls] == [
        [str(A.evaluate(s))] for s in task.data["steps"]]
    assert not any(r.info["tool_error"] or r.info["malformed"] for r in calls)


def test_answers_are_scored_by_exact_value():
  [task] = A.tasks("train", 1, 0, operations=(2,))  # the van: 2258
  for answer, reward in (("2258", 1.0), (" 2258.\n", 1.0), ("2258.0", 1.0),
                         ("2259", 0.0), ("2257.5", 0.0), ("-2258", 0.0),
                         ("The answer is 2258", 0.0), ("4516/2", 0.0), ("", 0.0),
                         ("<think>it is 7</think>2258", 1.0), ("2258<|im_end|>", 1.0)):
    env = envs.make("arithmetic")
    env.reset(task)
    result = env.step(answer)
    assert result.terminated and result.reward == reward, answer
    assert result.info["success"] is bool(reward)


def test_tool_errors_are_observations():
  [task] = A.tasks("train", 1, 0, operations=(2,))
  env = envs.make("arithmetic", format_penalty=0.5)
  env.reset(task)
  for action, observation in (
      (call("1260 / 0"), "Error: calculate raised CalcError: division by zero."),
      (call("45 *"), "Error: calculate raised CalcError: invalid expression (SyntaxError)."),
      (call("2 ** 8"), "Error: calculate raised CalcError: only numbers, parentheses and "
                       "+ - * / are allowed, not '2 ** 8'."),
      (tools.render_call("calculate", {"expr": "1"}),
       "Error: calculate: missing required argument(s) expression."),
      ("<tool_call>{not json</tool_call>", None)):
    result = env.step(action)
    assert not result.terminated and result.info["tool_error"], action
    assert result.info["reward_parts"] == dict.fromkeys(REWARD_PARTS, 0.0) | {"format": -0.5}
    if observation is not None:
      assert result.observation == [observation]
  # The episode goes on: the expert's calls and answer still score.
  for action in (call("45 * 28"), call("1260 + 998"), "2258"):
    result = env.step(action)
  assert result.terminated and result.info["success"]


def test_expert_episodes_through_the_rollout_engine(qwen_tokenizer):
  tasks = [A.tasks("test", 1, 0, operations=(k,))[0] for k in (2, 3, 4)]
  engine = RolloutEngine(lambda: envs.make("arithmetic"), qwen_tokenizer,
                         T.get_format("qwen2.5"), config=RolloutConfig(max_turns=5))
  trajs = engine.run(tasks, 1, expert=True).trajectories
  engine.close()
  by_id = {t.task_id: t for t in tasks}
  assert sorted(tr.metadata["task_id"] for tr in trajs) == sorted(by_id)
  for traj in trajs:
    task = by_id[traj.metadata["task_id"]]
    assert traj.metadata["success"] and traj.reward == 1.0 and traj.terminated
    assert traj.metadata["tool_calls"] == task.level + 2
    assert traj.metadata["n_turns"] == task.level + 3
    actions = decoded(traj, Role.ASSISTANT, qwen_tokenizer)
    assert actions == [call(s) + "<|im_end|>" for s in task.data["steps"]] + [
        f"{task.data['answer']}<|im_end|>"]
    # Each step's result comes back in a tool response the next step uses.
    responses = decoded(traj, Role.OBSERVATION, qwen_tokenizer)
    assert len(responses) == len(task.data["steps"])
    for step, response in zip(task.data["steps"], responses):
      assert f"<tool_response>\n{A.evaluate(step)}\n</tool_response>" in response
    # The schema sits in the system turn.
    assert '"name": "calculate"' in decoded(traj, Role.SYSTEM, qwen_tokenizer)[0]
