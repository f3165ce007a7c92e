"""Episodes as JSON records: what was trained on, token by token.

One record per episode, every per-token list aligned with `tokens` (the
episode's ids in order, exactly as the sampler saw them):

  tokens, pieces       ids and the text each adds (decoded in context)
  role                 "system" | "assistant" | "observation" per token
  loss_mask            1 where a loss is (the episode's own actions)
  turn                 k on the k-th action's tokens, -1 elsewhere
  sampler_logprob      the rollout's log-prob of each action token (None
                       elsewhere, and on tokens that were not sampled)
  trainer_logprob      the trainer's, before the update (None where not
                       computed: evaluation, or no trainer forward)
  advantage            the advantage painted on each action token (None
                       when not trained: evaluation)
  window_start         per action, the token where the context it was
                       sampled and trained in resumes after the prompt
                       (sliding windows), or None: the whole prefix
plus the episode's task, group, iteration, phase, returns (per turn, with
their reward parts), stop reason, terminated / truncated and the policy
version of each action. `write_jsonl` / `read_jsonl` store them.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Sequence

import numpy as np

from agentrl_jax.trajectory import TokenBatch, Trajectory

_PIECE_CONTEXT = 8  # tokens decoded before each one, so multi-byte pieces come out whole
_INCOMPLETE = "\ufffd"  # what a decoder shows for a partial UTF-8 sequence


def pieces(tok, ids: Sequence[int]) -> list[str]:
  """The text each token adds, decoded after up to 8 tokens of context.

  A byte-level BPE token may hold part of a character: such a token gets
  "" and the token that completes the character gets all of it, so the
  pieces join to the decoded text.
  """
  out = []
  for i in range(len(ids)):
    ctx = list(ids[max(0, i - _PIECE_CONTEXT):i])
    before = tok.decode(ctx).rstrip(_INCOMPLETE) if ctx else ""
    text = tok.decode(ctx + [int(ids[i])])
    out.append("" if text.endswith(_INCOMPLETE) else text[len(before):])
  return out


def _per_turn_tokens(batch: TokenBatch, key: np.ndarray, seq: int) -> dict[int, np.ndarray]:
  """Per turn of trajectory `seq`, its values of `key` on the batch's
  trained tokens, in order (each action is trained in exactly one view)."""
  on = (batch.seq_ids == seq) & (batch.turn_index >= 0) & (batch.loss_mask > 0)
  turns = batch.turn_index[on]
  values = key[on]
  return {int(t): values[turns == t] for t in np.unique(turns)}


def episode_record(traj: Trajectory, tok, *, iteration: int, phase: str,
                   batch: TokenBatch | None = None, seq: int | None = None,
                   trainer_logprobs: np.ndarray | None = None,
                   label: str | None = None) -> dict[str, Any]:
  """One episode's record; with `batch` (the collated, credited batch it is
  row `seq` of) its advantages and, given, the trainer's log-probs [B, L]."""
  flat = traj.flatten_all()
  roles = [seg.role.value for seg in traj.segments for _ in seg.token_ids]
  n = len(flat.ids)
  advantage: list = [None] * n
  trainer: list = [None] * n
  if batch is not None:
    places = {int(t): np.flatnonzero(flat.turn_index == t) for t in np.unique(flat.turn_index)
              if t >= 0}
    for key, out in ((batch.advantages, advantage), (trainer_logprobs, trainer)):
      if key is None:
        continue
      for turn, values in _per_turn_tokens(batch, key, seq).items():
        for pos, value in zip(places.get(turn, ()), values):
          out[pos] = float(value)
  offsets = np.cumsum([0] + [len(s) for s in traj.segments])
  windows = (None if traj.context_starts is None
             else [int(offsets[s]) for s in traj.context_starts[:traj.num_turns]])
  meta = traj.metadata
  return {
      "iteration": iteration, "phase": phase, "label": label,
      "task_id": meta.get("task_id"), "group_id": meta.get("group_id"),
      "reward": float(traj.reward), "success": bool(meta.get("success", False)),
      "turn_rewards": [float(r) for r in traj.turn_rewards or []],
      "turn_reward_parts": meta.get("turn_reward_parts", []),
      "stop_reason": meta.get("stop_reason"), "terminated": bool(traj.terminated),
      "truncated": bool(traj.truncated), "policy_versions": meta.get("policy_versions", []),
      "tokens": [int(t) for t in flat.ids], "pieces": pieces(tok, flat.ids),
      "role": roles, "loss_mask": [int(m) for m in flat.loss_mask],
      "turn": [int(t) for t in flat.turn_index],
      "sampler_logprob": [float(lp) if has else None
                          for lp, has in zip(flat.logprobs, flat.has_logprobs)],
      "trainer_logprob": trainer, "advantage": advantage, "window_start": windows,
  }


def sample_groups(trajs: Sequence[Trajectory], per_group: int = 2) -> list[int]:
  """Indices of up to `per_group` episodes of each group: its best and its
  worst return first, then the next ones in order."""
  groups: dict[Any, list[int]] = {}
  for i, t in enumerate(trajs):
    groups.setdefault(t.metadata.get("group_id"), []).append(i)
  out = []
  for members in groups.values():
    by_reward = sorted(members, key=lambda i: trajs[i].reward)
    picks = list(dict.fromkeys([by_reward[-1], by_reward[0], *members]))
    out += picks[:per_group]
  return out


def write_jsonl(path: str | pathlib.Path, records: Sequence[dict], append: bool = True) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a" if append else "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line]
