"""FrozenLake as text: gymnasium's FrozenLake with a new map per task.

Each turn the grid is drawn as rows of S F H G with `@` at the agent, plus
"You are at row r, column c." (1-based, row 1 at the top) and, with
`neighbours`, "Next to you: left F, down H, right F, up edge." (what each
move steps onto; at an edge it stays put). The agent answers
`<move>left|down|right|up</move>`. Dynamics are gymnasium's own (optionally
slippery), seeded per task so an episode replays exactly.

Rewards: outcome 1.0 on reaching G (0 on a hole); with `shaped_reward > 0`,
each move also earns shaped_reward x (decrease of the shortest-path distance
to G; negative when it grows) as "process" reward, so credit-assignment
studies get a per-turn signal.

Maps drawn with `tasks(..., decoy=True)` have a second exit, a door D in
the top-right or bottom-left corner (G stays bottom-right; S reaches each
without passing the other; " D" is one token of the bundled tokenizer, as
" G" is), and D ends the episode unpaid. With `demo_exits="either"` the
expert leaves by G or D, a fair coin per map, so demonstrations show how
to walk to an exit but not which one pays: what SFT cannot learn from
them and RL can from the reward.
"""

from __future__ import annotations

import collections
import random
from typing import Any, Sequence

from gymnasium.envs.toy_text import frozen_lake

from agentrl_jax.envs.base import Expert, Task, TextEnvironment, hashed_split
from agentrl_jax.envs.grid import DELTAS, MOVES, POSITION, read_move

SPLITS = ("train", "test")
EXPERT_TIES = ("first", "random")
DEMO_EXITS = ("goal", "either")
EXITS = "GD"  # each ends the episode; only G pays
_PROMPT = "Walk from S to G across the frozen lake without falling into a hole (H)."
_DECOY_PROMPT = _PROMPT + " D is a door out: leaving by it earns nothing."


def _distances(desc: Sequence[str], exit_: str = "G") -> dict[tuple[int, int], int]:
  """Shortest-path distance to exit `exit_` from every cell that can reach
  it (BFS backwards from it through cells that are neither a hole nor the
  other exit)."""
  size = len(desc)
  goal = next((r, c) for r in range(size) for c in range(size) if desc[r][c] == exit_)
  dist, queue = {goal: 0}, collections.deque([goal])
  while queue:
    r, c = queue.popleft()
    for dr, dc in DELTAS:
      cell = (r + dr, c + dc)
      if (0 <= cell[0] < size and 0 <= cell[1] < size and cell not in dist
          and desc[cell[0]][cell[1]] not in "H" + EXITS):
        dist[cell] = dist[(r, c)] + 1
        queue.append(cell)
  return dist


def _with_decoy(desc: Sequence[str], rng: random.Random) -> tuple[str, ...] | None:
  """`desc` with a door D in the top-right or bottom-left corner, or None
  when S cannot reach both exits."""
  n = len(desc)
  rows = [list(row) for row in desc]
  r, c = rng.choice([(0, n - 1), (n - 1, 0)])
  rows[r][c] = "D"
  out = tuple("".join(row) for row in rows)
  return out if all((0, 0) in _distances(out, e) for e in EXITS) else None


def _neighbour(cell: tuple[int, int], move: int, size: int) -> tuple[int, int]:
  """Where `move` leads from `cell` (walls keep you in place, as in gymnasium)."""
  r, c = cell[0] + DELTAS[move][0], cell[1] + DELTAS[move][1]
  return (min(max(r, 0), size - 1), min(max(c, 0), size - 1))


class FrozenLakeEnv(TextEnvironment):
  """Text FrozenLake.

  Args:
    is_slippery: gymnasium's slippery dynamics (the intended move happens
      with probability 1/3).
    shaped_reward: "process" reward per unit decrease of the distance to G.
    neighbours: each observation also names the cell every move steps onto,
      a line just before the agent's answer: a policy that reads it keeps
      out of holes without finding `@`'s column in the grid.
    expert_ties: which of several shortest-path moves the expert takes:
      "first" (in the order left, down, right, up) or "random" (uniformly,
      seeded by the map): demonstrations that do not always say "down"
      where down is one of the shortest moves.
    demo_exits: where the expert walks on a map with a second exit D:
      "goal" (to G) or "either" (to G or D, a fair coin seeded by the map).
  """

  system_prompt = (
      "You walk on a frozen lake drawn as a grid: S start, F frozen (safe), "
      "H hole, G goal, @ you. Row 1 is the top row and column 1 the leftmost. "
      "Reach G without stepping into a hole. Each turn move one cell with "
      "<move>left</move>, <move>down</move>, <move>right</move> or "
      "<move>up</move>. You may reason first inside <think>...</think>.")
  stop_strings = ("</move>",)

  def __init__(self, *, is_slippery: bool = False, shaped_reward: float = 0.0,
               neighbours: bool = False, expert_ties: str = "first",
               demo_exits: str = "goal", format_penalty: float = 0.0,
               step_cost: float = 0.0):
    super().__init__(format_penalty=format_penalty, step_cost=step_cost)
    if expert_ties not in EXPERT_TIES:
      raise ValueError(f"expert_ties must be one of {EXPERT_TIES}, got {expert_ties!r}")
    if demo_exits not in DEMO_EXITS:
      raise ValueError(f"demo_exits must be one of {DEMO_EXITS}, got {demo_exits!r}")
    self.is_slippery, self.shaped_reward = is_slippery, shaped_reward
    self.neighbours, self.expert_ties, self.demo_exits = neighbours, expert_ties, demo_exits
    self._gym: frozen_lake.FrozenLakeEnv | None = None

  @classmethod
  def tasks(cls, split: str, n: int, seed: int, *, sizes: tuple[int, ...] = (4, 5),
            p: float = 0.8, decoy: bool = False) -> list[Task]:
    """`n` distinct maps of `split` (a hash partition of the map: about 1 in 5
    is a test map); sizes drawn uniformly, `p` = probability of frozen cell;
    `decoy`: each map has a second exit D (module docstring). Level = size -
    4 (4x4 is level 0)."""
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    rng, out, seen = random.Random(seed), [], set()
    for _ in range(100 * n + 1000):  # generous: each draw succeeds ~1 in 5
      if len(out) == n:
        break
      size = rng.choice(sizes)
      desc = tuple(frozen_lake.generate_random_map(size, p, seed=rng.randrange(2**31)))
      if decoy:
        desc = _with_decoy(desc, rng)
        if desc is None:
          continue
      where, digest = hashed_split("/".join(desc))
      if digest in seen or where != split:
        continue
      seen.add(digest)
      out.append(Task(f"frozenlake/{size}x{size}/{digest[:16]}",
                      _DECOY_PROMPT if decoy else _PROMPT,
                      {"desc": desc, "env_seed": int(digest[:8], 16)}, max(size - 4, 0)))
    if len(out) < n:
      raise ValueError(f"found only {len(out)} of {n} distinct {split} maps for sizes {sizes}")
    return out

  def expert(self, task: Task) -> Expert:
    """Takes a shortest-path move to its exit (G, or as `demo_exits` picks)
    from the position in each observation (re-planning every turn, so it
    copes with slipping); among several, the one `expert_ties` picks."""
    desc = task.data["desc"]
    seeded = random.Random(task.data["env_seed"])
    either = self.demo_exits == "either" and any("D" in row for row in desc)
    dist = _distances(desc, seeded.choice(EXITS) if either else "G")
    rng = seeded if self.expert_ties == "random" else None

    def policy(observation: str) -> str:
      r, c = map(int, POSITION.findall(observation)[-1])
      here = (r - 1, c - 1)
      remaining = [dist.get(_neighbour(here, m, len(desc)), len(desc) ** 2)
                   for m in range(len(MOVES))]
      best = [m for m, d in enumerate(remaining) if d == min(remaining)]
      move = rng.choice(best) if rng is not None else best[0]
      return f"<move>{MOVES[move]}</move>"

    return policy

  def _reset(self, task: Task) -> str:
    self._close_gym()
    self._desc = task.data["desc"]
    self._dist = _distances(self._desc)
    self._gym = frozen_lake.FrozenLakeEnv(desc=list(self._desc), is_slippery=self.is_slippery)
    self._state, _ = self._gym.reset(seed=task.data["env_seed"])
    return f"{task.prompt}\n\n{self._render()}"

  def _step(self, action: str) -> tuple[str, dict[str, float], bool, dict[str, Any]]:
    move = read_move(self, action)
    if isinstance(move, tuple):
      return move
    word = MOVES[move]
    before = self._cell()
    self._state, reward, terminated, _, _ = self._gym.step(move)
    after = self._cell()
    terminated = terminated or self._desc[after[0]][after[1]] == "D"  # gymnasium reads D as frozen
    parts = {"outcome": float(reward)}
    if after in self._dist:  # not a hole
      parts["process"] = self.shaped_reward * (self._dist[before] - self._dist[after])
    if after != _neighbour(before, move, len(self._desc)):
      message = f"You tried to move {word} but slipped."
    else:
      message = f"You moved {word}."
    if self._desc[after[0]][after[1]] == "H":
      message += " You fell into a hole."
    elif reward > 0:
      message += " You reached the goal!"
    elif terminated:
      message += " You left by the door D: no reward."
    return f"{message}\n\n{self._render()}", parts, terminated, {"position": after}

  def state_key(self, observation: str) -> tuple[int, int]:
    """The position: on one map, that is the whole state."""
    del observation
    return self._cell()

  def close(self) -> None:
    self._close_gym()
    super().close()

  def _close_gym(self) -> None:
    if self._gym is not None:
      self._gym.close()
      self._gym = None

  def _cell(self) -> tuple[int, int]:
    return divmod(int(self._state), len(self._desc))

  def _render(self) -> str:
    r, c = self._cell()
    rows = [" ".join("@" if (i, j) == (r, c) else ch for j, ch in enumerate(row))
            for i, row in enumerate(self._desc)]
    text = "\n".join(rows) + f"\nYou are at row {r + 1}, column {c + 1}."
    if self.neighbours:
      cells = []
      for move, word in enumerate(MOVES):
        nr, nc = _neighbour((r, c), move, len(self._desc))
        cells.append(f"{word} {'edge' if (nr, nc) == (r, c) else self._desc[nr][nc]}")
      text += "\nNext to you: " + ", ".join(cells) + "."
    return text
