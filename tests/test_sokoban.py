"""Tests for text Sokoban: hand-counted rooms, the solver, the generator, the expert."""

import collections
import random

import pytest

from agentrl_jax import envs
from agentrl_jax import tokenizer as T
from agentrl_jax.envs.base import REWARD_PARTS, Task, hashed_split
from agentrl_jax.envs.sokoban import SokobanEnv, draw, parse, random_room, solve

# P at (1,1), the box at (2,2), the target at (3,4) (0-based). Shortest: 6
# moves; 3 pushes, 1 walk to the first pushing side and 2 to turn the corner
# (down, right, right, up, right, down).
ROOM = ("######",
        "#P___#",
        "#_X__#",
        "#___O#",
        "######")
# The box is in the top-right corner, off its target: it can never move.
STUCK = ("######",
         "#_P_X#",
         "#__#_#",
         "#_O__#",
         "######")
# Two boxes; one starts on its target at (1,2), the other target is (1,4).
TWO = ("#######",
       "#P*_O_#",
       "#__X__#",
       "#_____#",
       "#######")


def task(room):
  return Task("t", "Push.", {"room": room, "optimal_moves": 0}, 0)


def moves(env, words):
  return [env.step(f"<move>{w}</move>") for w in words]


def test_render_by_hand():
  obs, info = SokobanEnv().reset(task(ROOM))
  assert obs == "Push.\n\n" + "\n".join(ROOM) + "\nYou are at row 2, column 2."
  assert info["state_key"] == ((1, 1), ((2, 2),))


def test_parse_and_draw_are_inverse():
  # Every symbol: S the player on a target, * a box on one, X and O.
  room = ("#######",
          "#S_X_##",
          "#_*_O_#",
          "#######")
  walls, targets, player, boxes = parse(room)
  assert player == (1, 1) and targets == {(1, 1), (2, 2), (2, 4)}
  assert boxes == {(1, 3), (2, 2)} and len(walls) == 7 + 3 + 2 + 7
  assert draw(walls, targets, player, boxes, (4, 7)) == room
  for r in (ROOM, STUCK, TWO):
    assert draw(*parse(r), (len(r), len(r[0]))) == r


def test_a_turn_costs_one_token_a_cell():
  """With the bundled tokenizer each cell and newline of the room is one
  token, so a turn of ROOM (5 x 6) in the react format is 57 tokens: the
  move 3 (<move>, down, </move>), "\\n<observation>" 2, "You moved down." 4,
  "\\n\\n" 2, the room 5 * 6 + 4 = 34, "\\n" 1, "You are at row 3,
  column 2." 9, "</observation>\\n" 2."""
  tok, fmt = T.load_tokenizer(), T.get_format("react")

  def count(text):
    return len(tok.encode(text, add_special_tokens=False))

  for r in (ROOM, STUCK, TWO, ("#####", "#S*X#", "#O__#", "#####")):
    assert count("\n".join(r)) == len(r) * len(r[0]) + len(r) - 1
  env = SokobanEnv()
  env.reset(task(ROOM))
  action = "<move>down</move>"
  obs = env.step(action).observation
  assert obs == ("You moved down.\n\n######\n#____#\n#PX__#\n#___O#\n######\n"
                 "You are at row 3, column 2.")
  prompt = fmt.prompt_text("Sokoban.", "Push.")
  assert count(fmt.render("Sokoban.", "Push.", [action], [obs])) - count(prompt) == 57


def test_push_onto_the_target_solves():
  env = SokobanEnv(step_cost=0.01)
  env.reset(task(ROOM))
  *walk, last = moves(env, ["down", "right", "right", "up", "right", "down"])
  assert [r.observation.split("\n")[0] for r in walk] == [
      "You moved down.", "You pushed right.", "You pushed right.",
      "You moved up.", "You moved right."]
  assert not any(r.terminated or r.info["success"] for r in walk)
  assert last.terminated and not last.truncated and last.info["success"]
  assert last.info["reward_parts"] == {"outcome": 1.0, "format": 0.0, "cost": -0.01,
                                       "process": 0.0}
  assert last.observation == ("You pushed down. All boxes are on targets!\n\n"
                              "######\n#____#\n#___P#\n#___*#\n"
                              "######\nYou are at row 3, column 5.")
  assert env.step("<move>up</move>").observation == envs.EPISODE_OVER


def test_walls_and_blocked_boxes():
  env = SokobanEnv()
  env.reset(task(STUCK))
  up = env.step("<move>up</move>")  # the outer wall: the player stays
  assert up.observation.startswith("You hit a wall.\n")
  assert "You are at row 2, column 3." in up.observation and up.reward == 0
  right, push = moves(env, ["right", "right"])
  assert "row 2, column 4." in right.observation
  # The wall behind the box: neither the box nor the player moves.
  assert push.observation.startswith("The box did not move.\n")
  assert "\n#__PX#\n" in push.observation and "row 2, column 4." in push.observation
  assert push.info["state_key"] == right.info["state_key"] == ((1, 3), ((1, 4),))
  assert push.info["deadlock"] and not push.terminated  # off by default


def test_malformed_actions():
  env = SokobanEnv(format_penalty=0.5)
  env.reset(task(ROOM))
  for action, start in [("<move>jump</move>", "Unknown move 'jump'"),
                        ("go left", "Invalid action. Use one of: <move>left</move>"),
                        ("<push>up</push>", "Unknown tool <push>.")]:
    result = env.step(action)
    assert result.observation.startswith(start) and not result.terminated
    assert result.info["malformed"] and "traceback" not in result.info
    assert result.info["reward_parts"] == dict.fromkeys(REWARD_PARTS, 0.0) | {"format": -0.5}
    assert result.info["state_key"] == ((1, 1), ((2, 2),))
  ok = env.step("<think>down first</think><move> Down </move>")
  assert ok.observation.startswith("You moved down.") and ok.reward == 0


def test_box_reward_on_and_off_targets():
  env = SokobanEnv(box_reward=0.25)
  obs, _ = env.reset(task(TWO))
  assert "#P*_O_#\n#__X__#" in obs
  off, on = moves(env, ["right", "right"])
  assert "#_SXO_#" in off.observation  # the player on the target it emptied
  assert off.info["reward_parts"]["process"] == -0.25 and off.info["boxes_on_target"] == 0
  assert "#_OP*_#" in on.observation
  assert on.info["reward_parts"]["process"] == 0.25 and on.info["boxes_on_target"] == 1
  assert not on.terminated and on.info["reward_parts"]["outcome"] == 0.0


def test_end_on_deadlock():
  # From ROOM: push the box right twice, then up into the top-right corner.
  words = ["down", "right", "right", "down", "right", "up"]
  for flag in (False, True):
    env = SokobanEnv(end_on_deadlock=flag)
    env.reset(task(ROOM))
    *before, last = moves(env, words)
    assert not any(r.terminated or r.info["deadlock"] for r in before)
    assert last.info["deadlock"] and last.terminated == flag and not last.info["success"]
    assert last.info["reward_parts"]["outcome"] == 0.0
    assert ("can no longer be solved" in last.observation) == flag
    player, boxes = last.info["state_key"]
    assert solve(*parse(ROOM)[:2], player, frozenset(boxes)) is None


def test_solver_by_hand():
  solution = solve(*parse(ROOM))
  assert len(solution) == 6
  env = SokobanEnv()
  env.reset(task(ROOM))
  assert moves(env, solution)[-1].info["success"]
  # The lower box right from (2,2), then up from (3,4): 2 + 1 + 2 + 1 moves.
  assert solve(*parse(TWO)) == ("down", "right", "right", "down", "right", "up")
  assert solve(*parse(("#######", "#P_X_O#", "#######"))) == ("right", "right", "right")
  assert solve(*parse(STUCK)) is None
  # Not a corner, but the box is against the top wall and its target is below.
  assert solve(*parse(("######", "#PX__#", "#_O__#", "######"))) is None


@pytest.mark.parametrize("boxes", [1, 2])
def test_generated_rooms_are_solvable_and_long(boxes):
  train = SokobanEnv.tasks("train", 30, 0, boxes=boxes)
  test = SokobanEnv.tasks("test", 10, 0, boxes=boxes)
  for split, tasks in (("train", train), ("test", test)):
    for t in tasks:
      room = t.data["room"]
      walls, targets, _, box_set = parse(room)
      assert len(room) == 6 and {len(row) for row in room} == {6}
      assert len(box_set) == len(targets) == boxes and not box_set <= targets
      assert all(row == "######" for row in (room[0], room[-1]))
      assert all(row[0] == row[-1] == "#" for row in room)
      optimal = len(solve(*parse(room)))
      assert optimal == t.data["optimal_moves"] >= 5
      assert t.level == max(optimal // 5 - 1, 0)
      assert hashed_split("/".join(room))[0] == split
      assert t.task_id.startswith(f"sokoban/6x6/{boxes}box/")
  assert len({t.task_id for t in train + test}) == 40
  assert not {t.data["room"] for t in train} & {t.data["room"] for t in test}
  assert SokobanEnv.tasks("test", 10, 0, boxes=boxes) == test
  assert SokobanEnv.tasks("test", 10, 1, boxes=boxes) != test
  many = SokobanEnv.tasks("train", 200, 1, boxes=boxes)  # enough to draw a room twice
  assert len({t.data["room"] for t in many}) == len({t.task_id for t in many}) == 200
  longer = SokobanEnv.tasks("train", 10, 0, boxes=boxes, min_moves=9)
  assert min(t.data["optimal_moves"] for t in longer) >= 9


def test_split_fractions():
  rng = random.Random(0)
  rooms = {random_room(rng, 6, 1) for _ in range(2000)} - {None}
  counts = collections.Counter(hashed_split("/".join(r))[0] for r in rooms)
  assert len(rooms) > 1000 and 0.15 < counts["test"] / len(rooms) < 0.25


def test_expert_solves_in_the_optimal_number_of_moves():
  tasks = SokobanEnv.tasks("test", 10, 0) + SokobanEnv.tasks("test", 10, 0, boxes=2)
  for t in tasks:
    env, expert = SokobanEnv(), SokobanEnv.expert(t)
    obs, _ = env.reset(t)
    for turn in range(1, t.data["optimal_moves"] + 1):
      result = env.step(expert(obs))
      obs = result.observation
      if result.terminated:
        break
    assert result.terminated and result.info["success"] and turn == t.data["optimal_moves"] >= 5


def test_expert_replans_after_a_detour():
  env, expert = SokobanEnv(), SokobanEnv.expert(task(ROOM))
  env.reset(task(ROOM))
  obs = moves(env, ["right", "right", "right"])[-1].observation  # away from the box
  for _ in range(20):
    result = env.step(expert(obs))
    obs = result.observation
    if result.terminated:
      break
  # From (1,4): left, left, push down, left, down, push right twice.
  assert result.info["success"] and env.turns == 3 + 7


def test_state_keys():
  a, b = SokobanEnv(), SokobanEnv()
  assert a.reset(task(ROOM))[1]["state_key"] == b.reset(task(ROOM))[1]["state_key"]
  up = a.step("<move>up</move>")  # the wall: same state
  assert up.info["state_key"] == ((1, 1), ((2, 2),))
  down = a.step("<move>down</move>")
  assert down.info["state_key"] == ((2, 1), ((2, 2),)) != up.info["state_key"]
  push = a.step("<move>right</move>")
  assert push.info["state_key"] == ((2, 2), ((2, 3),))
  # Two boxes: sorted, whatever order they were pushed in.
  c = SokobanEnv()
  assert c.reset(task(TWO))[1]["state_key"] == ((1, 1), ((1, 2), (2, 3)))


def test_contract_and_registry():
  env = envs.make("sokoban", box_reward=0.1)
  assert isinstance(env, SokobanEnv) and env.box_reward == 0.1
  spec = envs.check(env, need_tasks=True, need_expert=True)
  assert spec.stop_strings == ("</move>",) and "* box on a target" in spec.system_prompt
  with pytest.raises(ValueError, match="known"):
    SokobanEnv.tasks("validation", 1, 0)
