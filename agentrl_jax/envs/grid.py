"""What the grid worlds (FrozenLake, Sokoban) share: the four moves and
how a `<move>...</move>` action is read.

MOVES are in gymnasium's FrozenLake order (action ids 0..3), DELTAS the
(row, column) step of each; POSITION reads "You are at row r, column c."
(1-based), the line every grid observation carries.
"""

from __future__ import annotations

import re

from agentrl_jax.envs.base import TextEnvironment, tool_call

MOVES = ("left", "down", "right", "up")
DELTAS = ((0, -1), (1, 0), (0, 1), (-1, 0))
POSITION = re.compile(r"You are at row (\d+), column (\d+)\.")
_USAGE = tuple(f"<move>{m}</move>" for m in MOVES)


def read_move(env: TextEnvironment, action: str) -> int | tuple[str, dict, bool, dict]:
  """The move `action` names (an index into MOVES), or the environment's
  reply to a malformed one (an observation with the format penalty)."""
  call = tool_call(action)
  rejected = env.reject(call, ("move",), _USAGE)
  if rejected:
    return rejected
  word = call[1].strip().lower()
  if word not in MOVES:
    return (f"Unknown move {word[:40]!r}. Use left, down, right or up.",
            {"format": -env.format_penalty}, False, {"malformed": True})
  return MOVES.index(word)
