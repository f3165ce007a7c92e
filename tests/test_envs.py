"""The environment contract, adapters and registry (on a toy environment)."""

import re
import time

import gymnasium
from gymnasium.utils.env_checker import check_env
import hypothesis
from hypothesis import strategies as st
import pytest

from agentrl_jax import envs
from agentrl_jax.envs import (
    FromGymnasium, SeedStyle, StepResult, Task, TextEnvironment, TurnBudget,
    as_gymnasium)


class Guess(TextEnvironment):
  """Guess the hidden number: <guess>n</guess>."""

  system_prompt = "Guess the number."
  stop_strings = ("</guess>",)

  def _reset(self, task):
    self.target = task.data["target"]
    return task.prompt

  def _step(self, action):
    if not action.startswith("<guess>"):
      return self.malformed(["<guess>n</guess>"])
    n = int(action[len("<guess>"):].split("<")[0])  # ValueError is an observation
    if n == self.target:
      return "Correct.", {"outcome": 1.0}, True, {"tool_call": True}
    return ("Higher." if n < self.target else "Lower."), {"process": 0.1}, False, {
        "tool_call": True}


TASKS = [Task(f"g{i}", f"Guess a number below 10 ({i}).", {"target": i}) for i in range(5)]


def test_text_environment_contract():
  env = Guess(format_penalty=0.5, step_cost=0.01)
  obs, info = env.reset(TASKS[3])
  assert obs == TASKS[3].prompt and info == {"task_id": "g3"}
  r = env.step("<guess>1</guess>")
  assert (r.observation, r.terminated, r.truncated) == ("Higher.", False, False)
  assert r.info["reward_parts"] == {"outcome": 0.0, "format": 0.0, "cost": -0.01,
                                    "process": 0.1}
  assert r.reward == pytest.approx(0.09)
  r = env.step("hello")  # malformed: an observation with the format penalty
  assert "Invalid action" in r.observation and r.reward == pytest.approx(-0.51)
  r = env.step("<guess>seven</guess>")  # a tool exception: also an observation
  assert r.observation.startswith("Error: ValueError") and r.info["tool_error"]
  assert not r.terminated and r.reward == pytest.approx(-0.51)
  r = env.step("<guess>3</guess>")
  assert r.terminated and not r.truncated and r.info["reward_parts"]["outcome"] == 1.0
  assert r.info["turn"] == 4


def test_reward_parts_are_validated():
  with pytest.raises(ValueError, match="unknown reward parts"):
    envs.reward_parts(bonus=1.0)
  with pytest.raises(ValueError, match="finite"):
    envs.reward_parts(outcome=float("nan"))


def test_turn_budget_truncates_never_terminates():
  env = TurnBudget(Guess(), max_turns=2)
  env.reset(TASKS[4])
  assert not env.step("<guess>0</guess>").truncated
  r = env.step("<guess>1</guess>")
  assert r.truncated and not r.terminated and r.info["turns"] == 2
  after = env.step("<guess>4</guess>")  # truncated stays truncated, pays nothing
  assert (after.observation, after.reward, after.terminated, after.truncated) == (
      envs.EPISODE_OVER, 0.0, False, True)
  env.reset(TASKS[4])  # the budget restarts with the episode
  r = env.step("<guess>4</guess>")
  assert r.terminated and not r.truncated
  after = env.step("<guess>4</guess>")
  assert (after.observation, after.reward, after.terminated, after.truncated) == (
      envs.EPISODE_OVER, 0.0, True, False)
  assert env.stop_strings == ("</guess>",)  # attributes pass through


def test_seed_style_adapter():
  class Seed:
    def reset(self, task):
      self.n = 0
      return "start"

    def step(self, action):
      self.n += 1
      if action == "crash":
        raise KeyError("x")
      return f"obs{self.n}", 0.5, self.n >= 2

  env = SeedStyle(Seed())
  assert env.reset(TASKS[0]) == ("start", {})
  assert env.step("a") == StepResult("obs1", 0.5, False, False, {"success": False})
  r = env.step("crash")
  assert r.observation == "Error: KeyError: 'x'" and not r.terminated
  assert env.step("b").terminated


def test_as_gymnasium_passes_check_env_and_round_trips():
  gym_env = as_gymnasium(Guess(), TASKS, max_length=256)
  check_env(gym_env, skip_render_check=True)
  obs, _ = gym_env.reset(seed=0, options={"task": TASKS[2]})
  assert obs == TASKS[2].prompt
  obs, reward, terminated, truncated, info = gym_env.step("<guess>2</guess>")
  assert (obs, terminated, truncated) == ("Correct.", True, False)
  # Non-printable characters are replaced to stay in the Text space.
  assert gym_env._fit("a\x00b", info) == "a?b" and info["raw_observation"] == "a\x00b"
  # And back: a gymnasium env as our Environment.
  env = FromGymnasium(as_gymnasium(Guess(), TASKS))
  obs, _ = env.reset(Task("x", "", {"seed": 0, "options": {"task": TASKS[1]}}))
  assert obs == TASKS[1].prompt
  assert env.step("<guess>1</guess>").terminated


def test_from_gymnasium_frozen_lake_with_a_parser():
  lake = gymnasium.make("FrozenLake-v1", desc=["SF", "FG"], is_slippery=False)
  words = {"left": 0, "down": 1, "right": 2, "up": 3}
  env = FromGymnasium(lake, render=lambda s: f"state {s}", parse=lambda a: words[a])
  assert env.reset(Task("l", "", {"seed": 0}))[0] == "state 0"
  r = env.step("jump")  # the parser's KeyError is an observation
  assert r.observation.startswith("Error: KeyError") and not r.terminated
  assert env.step("right").observation == "state 1"
  r = env.step("down")
  assert r.terminated and r.reward == 1.0


def test_registry():
  assert envs.registered() == ("arithmetic", "calculator", "frozen_lake", "python_tool",
                               "search_qa", "search_qa_tools", "sokoban")
  envs.register("guess_test", Guess)
  try:
    a, b = envs.make("guess_test"), envs.make("guess_test")
    assert isinstance(a, Guess) and a is not b
    with pytest.raises(ValueError, match="already registered"):
      envs.register("guess_test", Guess)
  finally:
    envs.registry._REGISTRY.pop("guess_test")
  with pytest.raises(ValueError, match="registered: \\('arithmetic', 'calculator'"):
    envs.make("chess")


def _tool_call_by_regex(action):
  """The backtracking regexes `tool_call` replaced: fine on short text."""
  text = re.sub(r"<think>.*?</think>", "", action, flags=re.DOTALL)
  match = re.search(r"<(\w+)>(.*?)</\1>", text, flags=re.DOTALL)
  return (match.group(1), match.group(2)) if match else None


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(
    ["<a>", "</a>", "<b>", "</b>", "<think>", "</think>", "<ab>", "</ab>", "<", ">",
     "/", "x", " ", "\n", "<é>", "</é>", "<a", "a>"]), max_size=14).map("".join))
def test_tool_call_matches_the_regex_definition(action):
  assert envs.tool_call(action) == _tool_call_by_regex(action)


def test_tool_call_cases():
  assert envs.tool_call("<think><move>up</move></think><move>down</move>") == ("move", "down")
  assert envs.tool_call("<think>x<move>up</move>") == ("move", "up")  # unclosed think
  assert envs.tool_call("<a><b>1</b></a>") == ("a", "<b>1</b>")
  assert envs.tool_call("<a>1</b> <b>2</b>") == ("b", "2")
  assert envs.tool_call("<a></a>") == ("a", "")
  assert envs.tool_call("<a>1") is None


@pytest.mark.parametrize("unit", ["<a>", "<think>", "<think></think><a>", "<a", "<<a>>"])
def test_tool_call_is_fast_on_unclosed_tags(unit):
  hostile = unit * (2**20 // len(unit))  # 1 MB
  distinct = "".join(f"<t{i}>" for i in range(2**20 // 9))  # as many names as tags
  for text in (hostile, distinct, "<think>" + hostile):
    t0 = time.thread_time()  # CPU time of this thread: holds on a loaded machine
    assert envs.tool_call(text) is None
    # Measured here (loaded machine): 1-36 ms. The backtracking regexes took about an hour.
    assert time.thread_time() - t0 < 0.1


def test_tool_call_is_linear_on_closed_tags():
  for text in ("</a><a>" * (2**20 // 7),  # every opening after a closing of its name
               "".join(f"</t{i}>" for i in range(2**16)) + "".join(
                   f"<t{i}>" for i in range(2**16)),
               "<a>" * (2**20 // 3) + "</a>"):
    t0 = time.thread_time()
    envs.tool_call(text)
    assert time.thread_time() - t0 < 1.0  # measured 4-100 ms; quadratic: hours
