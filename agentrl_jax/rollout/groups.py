"""GroupQueue: episodes by group, until every member of a group finished.

A call hands out only complete groups (members adjacent, groups in the
order they were made), since group-relative credit needs all of a group's
returns. Unfinished episodes (partial rollouts) and the finished members of
groups still running carry over to the next call.
"""

from __future__ import annotations

import collections
from typing import Iterator

from agentrl_jax.rollout.episode import Episode


class GroupQueue:
  """The episodes a sequence of calls carries over, grouped."""

  def __init__(self, group_ids: Iterator[int]):
    self._group_ids = group_ids  # shared by an engine's queues: ids stay unique
    self._sizes: dict[int, int] = {}  # members of each open group
    self.unfinished: list[Episode] = []
    self.finished: list[Episode] = []  # members of open groups
    self.version: int | None = None  # the policy the last call sampled from

  def __len__(self) -> int:
    return len(self.unfinished) + len(self.finished)

  def new_group(self, size: int) -> int:
    group = next(self._group_ids)
    self._sizes[group] = size
    return group

  def add(self, episodes: list[Episode]) -> None:
    """Takes back every episode of a call (the unfinished replace the carried)."""
    self.unfinished = [ep for ep in episodes if not ep.done]
    self.finished += [ep for ep in episodes if ep.done]

  def pop_complete(self) -> list[Episode]:
    """The finished episodes of every complete group, members adjacent."""
    groups = collections.defaultdict(list)
    for ep in self.finished:
      groups[ep.group].append(ep)
    complete = [g for g, eps in groups.items() if len(eps) == self._sizes[g]]
    self.finished = [ep for ep in self.finished if ep.group not in complete]
    for g in complete:
      del self._sizes[g]
    return [ep for g in sorted(complete) for ep in groups[g]]
