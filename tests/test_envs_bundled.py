"""Tests for the bundled environments: SearchQA, Calculator, FrozenLake, Sokoban."""

import collections
import dataclasses

import pytest

from agentrl_jax import envs
from conftest import assert_stays_over

from agentrl_jax.envs.base import REWARD_PARTS, Task
from agentrl_jax.envs.calculator import CalcError, CalculatorEnv, format_number, safe_eval
from agentrl_jax.envs import frozen_lake
from agentrl_jax.envs.frozen_lake import FrozenLakeEnv
from agentrl_jax.envs.search_qa import SearchQAEnv, exact_match, normalize_answer
from agentrl_jax.envs.sokoban import SokobanEnv

ENVS = (SearchQAEnv, CalculatorEnv, FrozenLakeEnv, SokobanEnv)


def rollout(env, task, policy, max_turns=50):
  """(observations, StepResults) of one episode."""
  obs, _ = env.reset(task)
  observations, results = [obs], []
  for _ in range(max_turns):
    result = env.step(policy(obs))
    obs = result.observation
    observations.append(obs)
    results.append(result)
    if result.terminated:
      break
  return observations, results


def content(task):
  return (task.prompt, repr(sorted(task.data.items())))


# ---------------------------------------------------------------- all envs

@pytest.mark.parametrize("cls", ENVS)
def test_tasks_deterministic_per_seed(cls):
  a, b, c = cls.tasks("train", 20, 0), cls.tasks("train", 20, 0), cls.tasks("train", 20, 1)
  assert a == b
  assert [t.task_id for t in a] != [t.task_id for t in c]
  assert len({t.task_id for t in a}) == 20  # distinct within a call


@pytest.mark.parametrize("cls", ENVS)
def test_train_test_disjoint(cls):
  train, test = cls.tasks("train", 200, 0), cls.tasks("test", 200, 0)
  assert not {t.task_id for t in train} & {t.task_id for t in test}
  assert not {content(t) for t in train} & {content(t) for t in test}
  with pytest.raises(ValueError, match="known"):
    cls.tasks("validation", 1, 0)


@pytest.mark.parametrize("cls", ENVS)
def test_expert_solves_test_tasks(cls):
  for task in cls.tasks("test", 20, 0):
    expert, actions = cls().expert(task), []

    def policy(obs, expert=expert, actions=actions):
      actions.append(expert(obs))
      return actions[-1]

    _, results = rollout(cls(), task, policy)
    assert results[-1].terminated and results[-1].info["reward_parts"]["outcome"] == 1.0
    assert all(a.endswith(cls.stop_strings) for a in actions)
    assert not any(r.info.get("malformed") or r.info["tool_error"] for r in results)


@pytest.mark.parametrize("cls", ENVS)
def test_terminal_means_terminal(cls):
  task = cls.tasks("test", 1, 0)[0]
  env, expert, actions = cls(step_cost=0.1), cls().expert(task), []
  _, results = rollout(env, task, lambda obs: actions.append(expert(obs)) or actions[-1])
  assert results[-1].terminated and results[-1].info["reward_parts"]["outcome"] == 1.0
  # The winning action again (it paid the outcome once), then anything.
  assert_stays_over(env, [actions[-1], "garbage", "<answer>x</answer>"])
  env.reset(task)  # a reset reopens the instance for a new episode
  assert env.step(actions[0]).observation != envs.EPISODE_OVER


@pytest.mark.parametrize("cls", ENVS)
@pytest.mark.parametrize("action", [
    "", "garbage", "<unknown>x</unknown>", "<search", "<answer>42", "x" * 1_000_000,
    "<think><answer>1</answer><move>up</move></think>", "\x00<<>>" * 1000])
def test_malformed_actions_are_observations(cls, action):
  env = cls(format_penalty=0.5)
  env.reset(cls.tasks("test", 1, 0)[0])
  result = env.step(action)
  assert not result.terminated and result.observation
  assert "traceback" not in result.info  # handled by the env, not the base's catch-all
  assert result.info.get("malformed") or result.info["tool_error"]
  assert result.info["reward_parts"] == dict.fromkeys(REWARD_PARTS, 0.0) | {"format": -0.5}
  assert len(result.observation) < 500


@pytest.mark.parametrize("cls", ENVS)
def test_unknown_tool_named(cls):
  env = cls()
  env.reset(cls.tasks("test", 1, 0)[0])
  result = env.step("<python>print(1)</python>")
  assert result.observation.startswith("Unknown tool <python>. Invalid action. Use one of: <")
  assert result.info["malformed"] and not result.info["tool_call"]


@pytest.mark.parametrize("cls", ENVS)
def test_isolation_interleaved_and_reset(cls):
  t1, t2 = cls.tasks("test", 2, 3)
  solo = [rollout(cls(), t, cls().expert(t))[0] for t in (t1, t2)]
  envs, experts = (cls(), cls()), (cls().expert(t1), cls().expert(t2))
  obs = [envs[0].reset(t1)[0], envs[1].reset(t2)[0]]
  seen, done = [[obs[0]], [obs[1]]], [False, False]
  while not all(done):
    for i in (0, 1):
      if not done[i]:
        result = envs[i].step(experts[i](obs[i]))
        obs[i], done[i] = result.observation, result.terminated
        seen[i].append(obs[i])
  assert seen == solo
  # Reusing one instance for a second episode behaves like a fresh one.
  env = cls()
  rollout(env, t1, cls().expert(t1))
  assert rollout(env, t2, cls().expert(t2))[0] == solo[1]


# ---------------------------------------------------------------- SearchQA

def test_normalize_and_exact_match():
  assert normalize_answer("  The Golden-Island! ") == "golden island"
  assert normalize_answer("an apple a day") == "apple day"
  assert exact_match("golden island.", "The Golden Island")
  assert not exact_match("Golden", "The Golden Island")
  # Listing candidates is not rewarded (containment would be).
  assert not exact_match("Paris, Golden Island, Rome", "Golden Island")


def test_search_qa_rewards_by_hand():
  task = SearchQAEnv.tasks("test", 1, 0, hops=(2,))[0]
  person_pid, city_pid = task.data["gold_passages"]
  env = SearchQAEnv(process_bonus=0.1, step_cost=0.01)
  env.reset(task)
  first = env.step(f"<think>start with the person</think><search>{task.data['person']}</search>")
  assert person_pid in first.info["retrieved"] and first.info["tool_call"]
  assert first.info["reward_parts"]["process"] == pytest.approx(0.1)
  assert first.reward == pytest.approx(0.1 - 0.01)
  assert first.observation.startswith("[1] ") and first.observation.count("\n") <= 2
  again = env.step(f"<search>{task.data['person']}</search>")
  assert again.info["reward_parts"]["process"] == 0.0  # bonus once per gold passage
  city = first.observation.split(" was born in ")[1].split(".")[0]
  second = env.step(f"<search>{city}</search>")
  assert city_pid in second.info["retrieved"]
  assert second.info["reward_parts"]["process"] == pytest.approx(0.1)
  final = env.step(f"<answer>the {task.data['answer'].upper()}</answer>")
  assert final.terminated and final.info["reward_parts"]["outcome"] == 1.0
  env.reset(task)
  wrong = env.step("<answer>Nowhere</answer>")
  assert wrong.terminated and not wrong.info["correct"]
  assert wrong.info["reward_parts"]["outcome"] == 0.0 and wrong.reward == pytest.approx(-0.01)


def test_search_qa_bm25_top3_has_gold_for_expert_query():
  for task in SearchQAEnv.tasks("test", 100, 1):
    env, expert = SearchQAEnv(), SearchQAEnv.expert(task)
    obs, _ = env.reset(task)
    for gold in task.data["gold_passages"]:  # one search per hop, in order
      result = env.step(expert(obs))
      assert gold in result.info["retrieved"][:3]
      obs = result.observation


def test_search_qa_options_and_levels():
  assert {t.level for t in SearchQAEnv.tasks("train", 50, 0, hops=(2,))} == {1}
  assert {t.level for t in SearchQAEnv.tasks("train", 50, 0, hops=(1,))} == {0}
  assert {t.level for t in SearchQAEnv.tasks("train", 100, 0)} == {0, 1}
  task = SearchQAEnv.tasks("test", 1, 0)[0]
  env = SearchQAEnv(top_k=5)
  env.reset(task)
  # Words in every person passage match many: exactly top_k come back.
  assert env.step("<search>born in founded wrote book</search>").observation.count("\n") == 4
  empty = env.step("<search>  ?! </search>")
  assert empty.info["tool_error"] and not empty.terminated
  with pytest.raises(ValueError, match="has"):
    SearchQAEnv.tasks("test", 10**6, 0)


# -------------------------------------------------------------- Calculator

@pytest.mark.parametrize("expr,value", [
    ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("-7 // 2", -4), ("7 % 3", 1),
    ("2 ** 10", 1024), ("84 / 8", 10.5), ("-(-3)", 3), ("2 ** -1", 0.5)])
def test_safe_eval_values(expr, value):
  assert safe_eval(expr) == value


@pytest.mark.parametrize("expr", [
    "__import__('os')", "x", "abs(1)", "2 ** 1000", "10 ** 20", "1 / 0",
    "().__class__", "'a' * 3", "True + 1", "lambda: 1", "[1]", "1 +", "",
    "(-8) ** 0.5", "9 ** 99 ** 99", "1" * 300, "1e308 * 10"])
def test_safe_eval_rejects(expr):
  with pytest.raises(CalcError):
    safe_eval(expr)


def test_format_number():
  assert (format_number(42.0), format_number(7), format_number(0.5)) == ("42", "7", "0.5")


def test_calculator_tool_and_answers_by_hand():
  task = Task("t", "Problem", {"answer": 1234, "steps": ("1000 + 234",)}, 0)
  env = CalculatorEnv(format_penalty=0.2)
  env.reset(task)
  ok = env.step("<calc>1000 + 234</calc>")
  assert ok.observation == "1000 + 234 = 1234" and ok.info["tool_call"] and ok.reward == 0
  bad = env.step("<calc>__import__('os').system('ls')</calc>")
  assert bad.observation.startswith("Error:") and bad.info["tool_error"]
  assert bad.reward == pytest.approx(-0.2) and not bad.terminated
  for answer, correct in [("1,234", True), ("1234.0000000001", True), ("1235", False),
                          ("abc", False), ("nan", False), ("", False)]:
    env.reset(task)
    result = env.step(f"<answer>{answer}</answer>")
    assert result.terminated and result.info["reward_parts"]["outcome"] == float(correct)


def test_calculator_levels_chain_steps():
  tasks = CalculatorEnv.tasks("train", 60, 0)
  assert {t.level for t in tasks} == {0, 1, 2}
  for task in tasks:
    steps = task.data["steps"]
    assert len(steps) == task.level + 1
    assert safe_eval(steps[-1]) == task.data["answer"]
    results = [format_number(safe_eval(s)) for s in steps]
    for j in range(len(steps) - 1):  # every intermediate result feeds a later step
      assert any(results[j] in later.split() for later in steps[j + 1:])
  assert {t.level for t in CalculatorEnv.tasks("test", 20, 0, levels=(2,))} == {2}


# -------------------------------------------------------------- FrozenLake

LAKE = Task("lake", "Walk.", {"desc": ("SFFF", "FHFH", "FFFH", "HFFG"), "env_seed": 0}, 0)


def test_frozen_lake_render_hole_and_shaping_by_hand():
  # Distances to G: S=(0,0) is 6, (0,1) is 5 (the hole at (1,1) blocks down).
  env = FrozenLakeEnv(shaped_reward=0.5)
  obs, _ = env.reset(LAKE)
  assert "@ F F F\nF H F H\nF F F H\nH F F G\nYou are at row 1, column 1." in obs
  up = env.step("<move>up</move>")  # wall: stay, distance unchanged
  assert up.info["reward_parts"]["process"] == 0.0 and "row 1, column 1." in up.observation
  right = env.step("<move> Right </move>")
  assert right.info["reward_parts"]["process"] == 0.5 and "row 1, column 2." in right.observation
  hole = env.step("<think>down looks short</think><move>down</move>")
  assert hole.terminated and hole.reward == 0.0 and "fell into a hole" in hole.observation
  assert env.step("<move>up</move>").observation == "The episode is over."


def test_frozen_lake_neighbours_by_hand():
  env = FrozenLakeEnv(neighbours=True)
  obs, _ = env.reset(LAKE)
  assert obs.endswith("You are at row 1, column 1.\n"
                      "Next to you: left edge, down F, right F, up edge.")
  # From (0,1): down is the hole at (1,1), left is S.
  right = env.step("<move>right</move>")
  assert right.observation.endswith("Next to you: left S, down H, right F, up edge.")
  # The expert still reads its position from the line above.
  assert FrozenLakeEnv().expert(LAKE)(right.observation) == "<move>right</move>"
  assert "Next to you" not in FrozenLakeEnv().reset(LAKE)[0]


def test_frozen_lake_expert_ties():
  # From S both down, to (1,0), and right, to (0,1), leave 5 moves to G.
  start = FrozenLakeEnv().reset(LAKE)[0]
  assert FrozenLakeEnv().expert(LAKE)(start) == "<move>down</move>"  # "first": in MOVES order
  env, firsts = FrozenLakeEnv(expert_ties="random"), collections.Counter()
  for seed in range(40):
    task = dataclasses.replace(LAKE, data={**LAKE.data, "env_seed": seed})
    firsts[env.expert(task)(start)] += 1
    _, results = rollout(env, task, env.expert(task))
    assert results[-1].info["reward_parts"]["outcome"] == 1.0 and len(results) == 6
    # Seeded by the map: the same task, the same demonstration.
    assert rollout(env, task, env.expert(task))[0] == rollout(env, task, env.expert(task))[0]
  assert firsts.keys() == {"<move>down</move>", "<move>right</move>"}
  assert min(firsts.values()) >= 10
  for task in FrozenLakeEnv.tasks("test", 20, 0):  # a shortest path on every map
    _, results = rollout(env, task, env.expert(task))
    assert results[-1].info["reward_parts"]["outcome"] == 1.0
    shortest = frozen_lake._distances(task.data["desc"])[(0, 0)]  # pylint: disable=protected-access
    assert len(results) == shortest
  with pytest.raises(ValueError, match="expert_ties"):
    FrozenLakeEnv(expert_ties="last")


DOOR = Task("door", "Walk.", {"desc": ("SFFD", "FHFF", "FFFH", "HFFG"), "env_seed": 0}, 0)


def test_frozen_lake_door_by_hand():
  # G's distances route around D: from (0,2) the shortest way to G goes down.
  dist = frozen_lake._distances(DOOR.data["desc"])  # pylint: disable=protected-access
  assert (0, 3) not in dist and dist[(0, 0)] == 6 and dist[(0, 2)] == 4
  env = FrozenLakeEnv()
  env.reset(DOOR)
  env.step("<move>right</move>")
  env.step("<move>right</move>")
  door = env.step("<move>right</move>")
  assert door.terminated and door.reward == 0.0 and "door D" in door.observation
  assert door.info["reward_parts"]["outcome"] == 0.0
  # The goal expert walks to G past the door.
  _, results = rollout(env, DOOR, env.expert(DOOR))
  assert results[-1].reward == 1.0 and len(results) == 6


def test_frozen_lake_decoy_maps_and_demonstrations():
  tasks = FrozenLakeEnv.tasks("train", 60, 0, sizes=(4,), decoy=True)
  assert FrozenLakeEnv.tasks("train", 60, 0, sizes=(4,)) == FrozenLakeEnv.tasks(
      "train", 60, 0, sizes=(4,), decoy=False)  # plain maps unchanged
  either, goal = FrozenLakeEnv(demo_exits="either"), FrozenLakeEnv()
  exits, placed = collections.Counter(), collections.Counter()
  for task in tasks:
    desc = task.data["desc"]
    where = {ch: (r, c) for r, row in enumerate(desc) for c, ch in enumerate(row) if ch in "GD"}
    assert sorted("".join(desc).replace("S", "").replace("F", "").replace("H", "")) == ["D", "G"]
    assert where["G"] == (3, 3) and where["D"] in {(0, 3), (3, 0)} and desc[0][0] == "S"
    assert "D is a door" in task.prompt
    placed[where["D"]] += 1
    for env in (either, goal):
      obs, results = rollout(env, task, env.expert(task))
      letter = "G" if results[-1].reward == 1.0 else "D"
      assert results[-1].terminated and (letter == "G" or "door D" in obs[-1])
      # A shortest path to the exit it took, avoiding the other one.
      shortest = frozen_lake._distances(desc, letter)[(0, 0)]  # pylint: disable=protected-access
      assert len(results) == shortest
      if env is goal:
        assert letter == "G"
      else:
        exits[letter] += 1
        assert rollout(env, task, env.expert(task))[0] == obs  # seeded by the map
  assert exits.keys() == {"G", "D"} and min(exits.values()) >= 20
  assert len(placed) == 2 and min(placed.values()) >= 20
  with pytest.raises(ValueError, match="demo_exits"):
    FrozenLakeEnv(demo_exits="both")


def test_frozen_lake_goal_and_unknown_move():
  env = FrozenLakeEnv()
  env.reset(LAKE)
  jump = env.step("<move>jump</move>")
  assert "Unknown move 'jump'" in jump.observation and not jump.terminated
  for move in ["down", "down", "right", "right", "down", "right"]:
    result = env.step(f"<move>{move}</move>")
  assert result.terminated and result.info["reward_parts"]["outcome"] == 1.0
  assert "reached the goal" in result.observation and result.info["position"] == (3, 3)
  after = env.step("<move>right</move>")
  assert after.reward == 0.0


def test_state_keys():
  env = FrozenLakeEnv()
  _, info = env.reset(LAKE)
  assert info["state_key"] == (0, 0)
  assert env.step("<move>up</move>").info["state_key"] == (0, 0)  # the wall
  assert env.step("<move>jump</move>").info["state_key"] == (0, 0)  # malformed
  assert env.step("<move>right</move>").info["state_key"] == (0, 1)
  calc = CalculatorEnv()
  _, info = calc.reset(Task("t", "Add  2\nand 3", {"answer": 5, "steps": ("2 + 3",)}, 0))
  assert info["state_key"] == "Problem: Add 2 and 3"
  assert calc.step("<calc>2+3</calc>").info["state_key"] == "2+3 = 5"
  task = SearchQAEnv.tasks("test", 1, 0, hops=(1,))[0]
  search = SearchQAEnv()
  _, info = search.reset(task)
  assert info["state_key"] == (f"Question: {task.prompt}", ())
  first = search.step(f"<search>{task.data['person']}</search>")
  again = search.step(f"<search>{task.data['person']}</search>")
  # The same results, but the gold passage is credited from the first on.
  assert first.info["state_key"] == again.info["state_key"]
  assert first.info["state_key"][1] == tuple(task.data["gold_passages"])
  assert first.info["state_key"][0] == " ".join(first.observation.split())


def test_frozen_lake_levels_match_size():
  tasks = FrozenLakeEnv.tasks("train", 40, 0, sizes=(4, 5, 6))
  assert {t.level for t in tasks} == {0, 1, 2}
  assert all(len(t.data["desc"]) == t.level + 4 for t in tasks)


def test_frozen_lake_slippery_expert_sometimes_succeeds_and_is_seeded():
  tasks = FrozenLakeEnv.tasks("test", 30, 0)
  outcomes = []
  for task in tasks:
    _, results = rollout(FrozenLakeEnv(is_slippery=True), task, FrozenLakeEnv().expert(task), 100)
    outcomes.append(results[-1].info["reward_parts"]["outcome"])
  assert 0 < sum(outcomes) < len(tasks)  # slipping makes some episodes fail
  replay = [rollout(FrozenLakeEnv(is_slippery=True), tasks[0],
                    FrozenLakeEnv().expert(tasks[0]), 100)[0] for _ in range(2)]
  assert replay[0] == replay[1]
