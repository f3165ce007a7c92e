"""Sokoban as text: RAGEN's long-horizon, sparse-reward puzzle.

Each turn the room is drawn as rows of symbols with no spaces between them
(as RAGEN draws it): # wall, _ floor, O target, X box, * box on a target,
P player, S player on a target (RAGEN's symbols, but * where RAGEN has the
multibyte √, so that every cell is one token of the bundled tokenizer and a
column is a token offset), then "You are at row r, column c." (1-based, row
1 at the top). The agent answers `<move>left|down|right|up</move>`; walking
into a box pushes it when the cell behind it is free. Boxes cannot be
pulled, so one careless push (into a corner, say) can doom the episode many
turns before it ends.

Rooms are made by gym-sokoban's reverse play (boxes start on their targets
and the player pulls them away; here by a random walk, where gym-sokoban and
RAGEN search the pulls depth-first), so every room is solvable; the BFS
solver then keeps those whose shortest solution is long enough.

Rewards: outcome 1.0 when every box is on a target (the episode terminates),
nothing else by default; with `box_reward > 0`, each push of a box onto a
target earns +box_reward and each push off one -box_reward, as "process".
With `end_on_deadlock`, a push of a box into a corner off target ends the
episode (terminated, outcome 0); otherwise only the turn budget does.
"""

from __future__ import annotations

import collections
import random
from typing import Any, Sequence

from agentrl_jax.envs.base import Expert, Task, TextEnvironment, hashed_split
from agentrl_jax.envs.grid import DELTAS, MOVES, POSITION, read_move

SPLITS = ("train", "test")
_PROMPT = "Push every box (X) onto a target (O)."

Cell = tuple[int, int]
State = tuple[Cell, frozenset]  # (player, boxes)


def parse(room: Sequence[str]) -> tuple[frozenset, frozenset, Cell, frozenset]:
  """(walls, targets, player, boxes) of a room drawn in the symbols above."""
  cells = [((r, c), ch) for r, row in enumerate(room) for c, ch in enumerate(row)]
  walls, targets, boxes = (frozenset(cell for cell, ch in cells if ch in symbols)
                           for symbols in ("#", "O*S", "X*"))
  (player,) = (cell for cell, ch in cells if ch in "PS")
  return walls, targets, player, boxes


def draw(walls: frozenset, targets: frozenset, player: Cell, boxes: frozenset,
         shape: tuple[int, int]) -> tuple[str, ...]:
  """The rows of a room in the symbols above (the inverse of `parse`)."""
  def symbol(cell):
    if cell in walls:
      return "#"
    if cell in boxes:
      return "*" if cell in targets else "X"
    if cell == player:
      return "S" if cell in targets else "P"
    return "O" if cell in targets else "_"
  return tuple("".join(symbol((r, c)) for c in range(shape[1])) for r in range(shape[0]))


def _push(walls: frozenset, player: Cell, boxes: frozenset, move: int) -> tuple[Cell, frozenset]:
  """(player, boxes) after `move`: a wall or a blocked box leaves both as they were."""
  dr, dc = DELTAS[move]
  ahead = (player[0] + dr, player[1] + dc)
  if ahead in walls:
    return player, boxes
  if ahead in boxes:
    beyond = (ahead[0] + dr, ahead[1] + dc)
    if beyond in walls or beyond in boxes:
      return player, boxes
    return ahead, boxes - {ahead} | {beyond}
  return ahead, boxes


def _cornered(walls: frozenset, box: Cell) -> bool:
  """A box between a wall above or below and one left or right: it can never move."""
  r, c = box
  return (((r - 1, c) in walls or (r + 1, c) in walls)
          and ((r, c - 1) in walls or (r, c + 1) in walls))


def solve(walls: frozenset, targets: frozenset, player: Cell,
          boxes: frozenset) -> tuple[str, ...] | None:
  """A shortest sequence of moves putting every box on a target (BFS over
  (player, boxes)), or None when there is none."""
  start = (player, boxes)
  parent: dict[State, tuple[State, int] | None] = {start: None}
  queue = collections.deque([start])
  while queue:
    state = queue.popleft()
    if state[1] <= targets:
      moves = []
      while parent[state] is not None:
        state, move = parent[state]
        moves.append(MOVES[move])
      return tuple(reversed(moves))
    for move in range(len(MOVES)):
      after = _push(walls, *state, move)
      # A cornered box off target can never reach one: prune that branch.
      if after not in parent and not any(_cornered(walls, b) for b in after[1] - targets):
        parent[after] = (state, move)
        queue.append(after)
  return None


def random_room(rng: random.Random, size: int, boxes: int) -> tuple[str, ...] | None:
  """A `size` x `size` room (outer wall included) by reverse play, or None
  when the carved floor is too small for `boxes` boxes and the player."""
  inner = range(1, size - 1)
  # Carve the floor with a random walk that turns now and then (gym-sokoban's
  # topology step, one cell at a time): size**2 steps leave ~60% of the inside
  # floor, so rooms get corridors and inner walls yet room to push in.
  cell, heading, floor = (rng.choice(inner), rng.choice(inner)), rng.choice(DELTAS), set()
  for _ in range(size * size):
    floor.add(cell)
    if rng.random() < 0.35:
      heading = rng.choice(DELTAS)
    ahead = (cell[0] + heading[0], cell[1] + heading[1])
    if ahead[0] in inner and ahead[1] in inner:
      cell = ahead
  if len(floor) < boxes + 2:
    return None
  walls = frozenset((r, c) for r in range(size) for c in range(size)) - floor
  placed = rng.sample(sorted(floor), boxes + 1)
  targets = frozenset(placed[1:])
  player, box_set = placed[0], targets
  # Reverse play: walk at random, pulling the box behind the player (the
  # inverse of a push) half the time one is there.
  for _ in range(10 * size * size):
    move = rng.randrange(len(MOVES))
    dr, dc = DELTAS[move]
    ahead, behind = (player[0] + dr, player[1] + dc), (player[0] - dr, player[1] - dc)
    if ahead in walls or ahead in box_set:
      continue
    if behind in box_set and rng.random() < 0.5:
      box_set = box_set - {behind} | {player}
    player = ahead
  return draw(walls, targets, player, box_set, (size, size))


class SokobanEnv(TextEnvironment):
  """Text Sokoban.

  Args:
    box_reward: "process" reward per box pushed onto a target (minus as much
      per box pushed off one).
    end_on_deadlock: end the episode (terminated, outcome 0) as soon as a box
      off target is pushed into a corner. Off by default, as in RAGEN: the
      episode then runs on until the engine's turn budget (`rollout.max_turns`)
      truncates it, and the corner check misses other deadlocks anyway; on,
      a doomed episode stops spending turns and its return is final.
  """

  system_prompt = (
      "You solve a Sokoban puzzle drawn as a grid: # wall, _ floor, O target, "
      "X box, * box on a target, P you, S you on a target. Row 1 is the top "
      "row and column 1 the leftmost. Push every box onto a target. Walking "
      "into a box pushes it one cell if the cell behind it is floor or a "
      "target; boxes cannot be pulled, so a box pushed into a corner is stuck "
      "for good. Each turn move one cell with <move>left</move>, "
      "<move>down</move>, <move>right</move> or <move>up</move>. You may reason "
      "first inside <think>...</think>.")
  stop_strings = ("</move>",)

  def __init__(self, *, box_reward: float = 0.0, end_on_deadlock: bool = False,
               format_penalty: float = 0.0, step_cost: float = 0.0):
    super().__init__(format_penalty=format_penalty, step_cost=step_cost)
    self.box_reward, self.end_on_deadlock = box_reward, end_on_deadlock

  @classmethod
  def tasks(cls, split: str, n: int, seed: int, *, size: int = 6, boxes: int = 1,
            min_moves: int = 5) -> list[Task]:
    """`n` distinct rooms of `split` (a hash partition of the room: about 1 in
    5 is a test room) whose shortest solution takes at least `min_moves`
    moves. Data: "room" (rows in the symbols above) and "optimal_moves".
    Level = optimal moves // 5 - 1 (under 10 moves: 0; 10-14: 1; ...)."""
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    rng, out, seen = random.Random(seed), [], set()
    for _ in range(100 * n + 1000):  # generous: ~1 in 5 is in the split, fewer long enough
      if len(out) == n:
        break
      room = random_room(rng, size, boxes)
      if room is None:
        continue
      where, digest = hashed_split("/".join(room))
      if digest in seen or where != split:
        continue
      seen.add(digest)
      solution = solve(*parse(room))
      if solution is None or len(solution) < max(min_moves, 1):
        continue
      moves = len(solution)
      out.append(Task(f"sokoban/{size}x{size}/{boxes}box/{digest[:16]}", _PROMPT,
                      {"room": room, "optimal_moves": moves}, max(moves // 5 - 1, 0)))
    if len(out) < n:
      raise ValueError(f"found only {len(out)} of {n} distinct {split} rooms of size {size} "
                       f"with {boxes} boxes and at least {min_moves} moves")
    return out

  @classmethod
  def expert(cls, task: Task) -> Expert:
    """Takes the first move of a shortest solution from the room drawn in each
    observation (re-planning every turn, so it copes with the model's own
    moves; from a deadlock, where none exists, it moves up)."""
    walls, targets, _, _ = parse(task.data["room"])
    height = len(task.data["room"])

    def policy(observation: str) -> str:
      where = list(POSITION.finditer(observation))[-1]
      rows = observation[:where.start()].splitlines()[-height:]
      _, _, player, boxes = parse(rows)
      solution = solve(walls, targets, player, boxes)
      return f"<move>{solution[0] if solution else 'up'}</move>"

    return policy

  def _reset(self, task: Task) -> str:
    room = task.data["room"]
    self._shape = (len(room), len(room[0]))
    self._walls, self._targets, self._player, self._boxes = parse(room)
    return f"{task.prompt}\n\n{self._render()}"

  def _step(self, action: str) -> tuple[str, dict[str, float], bool, dict[str, Any]]:
    move = read_move(self, action)
    if isinstance(move, tuple):
      return move
    word = MOVES[move]
    before = len(self._boxes & self._targets)
    player, boxes = _push(self._walls, self._player, self._boxes, move)
    dr, dc = DELTAS[move]
    ahead = (self._player[0] + dr, self._player[1] + dc)
    # Short messages: the room redrawn below says the rest, and every token
    # of an observation is paid for again on each later turn.
    if boxes != self._boxes:
      message = f"You pushed {word}."
    elif ahead in self._boxes:
      message = "The box did not move."
    elif player == self._player:
      message = "You hit a wall."
    else:
      message = f"You moved {word}."
    self._player, self._boxes = player, boxes
    on_target = len(boxes & self._targets)
    solved = boxes <= self._targets
    deadlock = any(_cornered(self._walls, b) for b in boxes - self._targets)
    if solved:
      message += " All boxes are on targets!"
    elif deadlock and self.end_on_deadlock:
      message += " A box is stuck in a corner: the puzzle can no longer be solved."
    parts = {"outcome": float(solved), "process": self.box_reward * (on_target - before)}
    info = {"position": player, "boxes_on_target": on_target, "deadlock": deadlock}
    return (f"{message}\n\n{self._render()}", parts,
            solved or (deadlock and self.end_on_deadlock), info)

  def state_key(self, observation: str) -> tuple[Cell, tuple[Cell, ...]]:
    """(player, sorted boxes): walls and targets are fixed, so the whole state."""
    del observation
    return self._player, tuple(sorted(self._boxes))

  def _render(self) -> str:
    rows = draw(self._walls, self._targets, self._player, self._boxes, self._shape)
    r, c = self._player
    return "\n".join(rows) + f"\nYou are at row {r + 1}, column {c + 1}."
