"""Trajectories: who authored which token, and how they become a padded batch.

A trajectory is a list of `Segment`s, each a run of token ids tagged with the
`Role` that authored it. Only ASSISTANT tokens (sampled by the policy,
including the stop sequence it emitted) are actions and get a loss; SYSTEM
(task prompt) and OBSERVATION (environment output plus any template tokens the
rollout wraps around it, such as the next assistant header) are context.

Alignment convention (docs/design.md, convention 1): every per-token array is
aligned with the token ids, so `loss_mask[i]`, `logprobs[i]`, `turn_index[i]`
describe `ids[i]`. `losses.token_logprobs` returns log p(ids[i] | ids[:i]) at
position i, so nothing here or downstream shifts a mask by hand.

Token ids are the ones the sampler consumed and produced; nothing in this
module decodes or re-encodes text.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from typing import Any, Sequence

import flax.struct
import jax
import numpy as np

DEFAULT_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)
_INT32_MAX = np.iinfo(np.int32).max


class Role(enum.Enum):
  SYSTEM = "system"  # task prompt, tool schemas: context, no loss
  ASSISTANT = "assistant"  # sampled by the policy: the only tokens with a loss
  OBSERVATION = "observation"  # environment output + template tokens: no loss


@dataclasses.dataclass(frozen=True)
class Segment:
  """A run of tokens authored by one role.

  token_ids: [n] token ids, exactly as the sampler saw or produced them.
  logprobs: [n] rollout log-probs of the sampled tokens under the policy
    the loss trains (ASSISTANT only; None for SYSTEM/OBSERVATION, and for
    ASSISTANT tokens that were not sampled, e.g. expert demonstrations).
  sampling_logprobs: [n] log-probs under the distribution each token was
    drawn from (the rollout's temperature, top-k and top-p; 0 for a greedy
    pick): the behaviour policy of the importance weights. None: drawn
    from the policy itself, so equal to `logprobs`.
  """

  role: Role
  token_ids: tuple[int, ...]
  logprobs: tuple[float, ...] | None = None
  sampling_logprobs: tuple[float, ...] | None = None

  def __post_init__(self):
    if not isinstance(self.role, Role):
      raise TypeError(f"Segment.role must be a Role, got {self.role!r}")
    ids = tuple(int(t) for t in np.asarray(self.token_ids).reshape(-1))
    if any(t < 0 or t > _INT32_MAX for t in ids):
      raise ValueError(f"token ids must be in [0, 2**31), got {ids}")
    object.__setattr__(self, "token_ids", ids)
    if self.logprobs is None and self.sampling_logprobs is not None:
      raise ValueError("sampling_logprobs without logprobs: record the policy's too")
    for name in ("logprobs", "sampling_logprobs"):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, self._checked(name, len(ids)))

  def _checked(self, name: str, n: int) -> tuple[float, ...]:
    if self.role != Role.ASSISTANT:
      raise ValueError(
          f"only ASSISTANT segments carry {name}; a {self.role.name} "
          "segment was never sampled from the policy")
    lps = tuple(float(x) for x in np.asarray(getattr(self, name)).reshape(-1))
    if len(lps) != n:
      raise ValueError(
          f"ASSISTANT segment has {n} tokens but {len(lps)} {name}; "
          "they must be aligned one to one")
    if not all(math.isfinite(x) for x in lps):
      raise ValueError(f"ASSISTANT {name} must be finite, got {lps}")
    if any(x > 1e-4 for x in lps):
      raise ValueError(
          f"ASSISTANT {name} must be <= 0 (log-probabilities, not "
          f"probabilities), got max {max(lps)}")
    return lps

  def __len__(self) -> int:
    return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class FlatTrajectory:
  """A trajectory's per-token arrays, all [L] and aligned with `ids`."""

  ids: np.ndarray  # [L] int32
  loss_mask: np.ndarray  # [L] float32, 1 on ASSISTANT tokens
  turn_index: np.ndarray  # [L] int32, k on the k-th ASSISTANT segment, else -1
  logprobs: np.ndarray  # [L] float32, rollout logprobs on ASSISTANT tokens, else 0
  has_logprobs: np.ndarray  # [L] bool, True where `logprobs` was recorded
  # [L] float32, the sampling distribution's log-probs where `logprobs` is
  # (`Segment.sampling_logprobs`, or the policy's), else 0
  sampling_logprobs: np.ndarray


@dataclasses.dataclass
class Trajectory:
  """One episode as the rollout recorded it.

  segments: the token runs in order.
  reward: the trajectory-level (terminal/outcome) reward.
  turn_rewards: optional per-turn rewards, one per ASSISTANT segment, in order
    (`turn_rewards[k]` is the reward for the k-th action).
  terminated: the task really ended (success or failure).
  truncated: a budget (turns, tokens, time) ran out first. Never both.
  metadata: free-form (task id, reward parts, n_turns, ...).
  context_starts: None when the policy saw the whole prefix before each action
    (append-only context). Under a sliding-window context policy, one entry
    per ASSISTANT segment: when it sampled action k the sampler held only the
    leading SYSTEM segments and `segments[context_starts[k]:]` up to action
    k. Training then teacher-forces each action in that context
    (`flatten_views`). A trajectory that ends on an observation (truncated:
    the state its return bootstraps from) may have one entry more, the window
    the next action would have seen.
  """

  segments: list[Segment] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  turn_rewards: list[float] | None = None
  terminated: bool = False
  truncated: bool = False
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
  context_starts: list[int] | None = None

  @property
  def num_turns(self) -> int:
    """Number of ASSISTANT segments (actions)."""
    return sum(s.role == Role.ASSISTANT for s in self.segments)

  def __len__(self) -> int:
    return sum(len(s) for s in self.segments)

  def validate(self) -> None:
    """Raises ValueError if the trajectory cannot be trained on as is."""
    if len(self) == 0:
      raise ValueError("empty trajectory: it has no tokens")
    if not math.isfinite(self.reward):
      raise ValueError(f"trajectory reward must be finite, got {self.reward}")
    if self.terminated and self.truncated:
      raise ValueError(
          "a trajectory is either terminated (the task ended) or truncated "
          "(a budget ran out), not both")
    if self.turn_rewards is not None:
      if len(self.turn_rewards) != self.num_turns:
        raise ValueError(
            f"turn_rewards has {len(self.turn_rewards)} entries but the "
            f"trajectory has {self.num_turns} ASSISTANT segments")
      if not all(math.isfinite(r) for r in self.turn_rewards):
        raise ValueError(f"turn rewards must be finite, got {self.turn_rewards}")
    if self.context_starts is not None:
      starts, actions = self.context_starts, self._action_indices()
      ends_on_observation = self.segments[-1].role == Role.OBSERVATION
      if len(starts) != len(actions) + (ends_on_observation and len(starts) > len(actions)):
        raise ValueError(
            f"context_starts has {len(starts)} entries but the trajectory has "
            f"{len(actions)} ASSISTANT segments (one more entry is allowed only "
            "when it ends on an observation)")
      n_sys = self._num_leading_system()
      for k, (start, act) in enumerate(zip(starts, [*actions, len(self.segments) - 1])):
        if not n_sys <= start <= act:
          raise ValueError(
              f"context_starts[{k}]={start} must lie between the leading SYSTEM "
              f"segments ({n_sys}) and action {k}'s segment ({act})")
      if any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"context_starts must not decrease, got {starts}")

  def _action_indices(self) -> list[int]:
    return [i for i, s in enumerate(self.segments) if s.role == Role.ASSISTANT]

  def _num_leading_system(self) -> int:
    n = 0
    while n < len(self.segments) and self.segments[n].role == Role.SYSTEM:
      n += 1
    return n

  def _flat(self, indices: Sequence[int], trained: Sequence[int]) -> FlatTrajectory:
    """Per-token arrays of segments[indices]; actions outside `trained` are context."""
    ids, mask, turn, lps, has_lp, sampling = [], [], [], [], [], []
    k_of = {i: k for k, i in enumerate(self._action_indices())}
    for i in indices:
      seg, n = self.segments[i], len(self.segments[i])
      ids.append(np.asarray(seg.token_ids, np.int32).reshape(n))
      is_trained = i in k_of and k_of[i] in trained
      mask.append(np.full(n, float(is_trained), np.float32))
      turn.append(np.full(n, k_of[i] if is_trained else -1, np.int32))
      has = is_trained and seg.logprobs is not None
      lps.append(np.asarray(seg.logprobs, np.float32) if has
                 else np.zeros(n, np.float32))
      has_lp.append(np.full(n, has, bool))
      drawn = seg.logprobs if seg.sampling_logprobs is None else seg.sampling_logprobs
      sampling.append(np.asarray(drawn, np.float32) if has else np.zeros(n, np.float32))
    cat = np.concatenate
    return FlatTrajectory(cat(ids), cat(mask), cat(turn), cat(lps), cat(has_lp),
                          cat(sampling))

  def flatten_all(self) -> FlatTrajectory:
    """All per-token arrays of the concatenated segments, aligned with ids."""
    self.validate()
    return self._flat(range(len(self.segments)), range(self.num_turns))

  def _view_groups(self) -> list[tuple[int, list[int]]]:
    """(context start, actions sampled in that context), in order."""
    groups: list[tuple[int, list[int]]] = []
    for k, start in enumerate(self.context_starts[:self.num_turns]):
      if groups and groups[-1][0] == start:
        groups[-1][1].append(k)
      else:
        groups.append((start, [k]))
    return groups

  @property
  def num_views(self) -> int:
    """How many sequences `flatten_views` returns."""
    if self.context_starts is None:
      return 1
    return max(len(self._view_groups()), 1) + (self._bootstrap_start() is not None)

  def _bootstrap_start(self) -> int | None:
    """Start of the final state's window when it differs from the last action's."""
    starts = self.context_starts
    if (starts is None or self.num_turns == 0 or len(starts) == self.num_turns
        or starts[-1] == starts[-2]):
      return None
    return starts[-1]

  def flatten_views(self) -> list[FlatTrajectory]:
    """The contexts the policy acted in, as one FlatTrajectory each.

    Append-only trajectories have one view, `flatten_all()`. Under a sliding
    window (`context_starts`), the actions sampled in the same window form
    one view: the leading SYSTEM segments, then segments from the window's
    start through the last of those actions (the final view runs to the
    trajectory's end). Only those actions carry loss mask, turn index and
    log-probs; earlier actions still inside the window are context (mask 0,
    turn -1), since their loss belongs to the view they were sampled in.
    When the final state's window (the extra `context_starts` entry) moved
    past the last action's, the last action's view ends at that action and
    one more view, with no trained tokens, holds the final state in the
    window the next action would have seen: its value is the bootstrap.
    """
    self.validate()
    if self.context_starts is None or not self.context_starts:
      return [self.flatten_all()]
    n_sys, actions = self._num_leading_system(), self._action_indices()
    groups, final = self._view_groups(), self._bootstrap_start()
    if final is not None:
      groups.append((final, []))
    views = []
    for g, (start, turns) in enumerate(groups):
      end = len(self.segments) if g == len(groups) - 1 else actions[turns[-1]] + 1
      views.append(self._flat([*range(n_sys), *range(start, end)], turns))
    return views

  def flatten(self) -> tuple[np.ndarray, np.ndarray]:
    """Returns (ids int32[L], loss_mask float32[L]); mask is 1 on ASSISTANT."""
    flat = self.flatten_all()
    return flat.ids, flat.loss_mask

  # -- Step-level view (Agent-R1 style records) ------------------------------

  def to_steps(self) -> tuple[tuple[int, ...], list[Step]]:
    """Splits into (prompt_ids, one Step per ASSISTANT segment).

    Requires the canonical layout the rollout produces: leading SYSTEM
    segment(s), then each ASSISTANT segment followed by at most one
    OBSERVATION segment. `Trajectory.from_steps` inverts this exactly.
    """
    self.validate()
    if self.context_starts is not None:
      raise ValueError("to_steps cannot represent a sliding-window trajectory "
                       "(context_starts); use flatten_views")
    segs = list(self.segments)
    prompt: list[int] = []
    while segs and segs[0].role == Role.SYSTEM:
      prompt.extend(segs.pop(0).token_ids)
    steps: list[Step] = []
    rewards = self.turn_rewards
    while segs:
      act = segs.pop(0)
      if act.role != Role.ASSISTANT:
        raise ValueError(
            f"to_steps needs SYSTEM* (ASSISTANT OBSERVATION?)*; found "
            f"{act.role.name} where an ASSISTANT segment was expected")
      obs: tuple[int, ...] = ()
      if segs and segs[0].role == Role.OBSERVATION:
        obs = segs.pop(0).token_ids
      k = len(steps)
      steps.append(Step(
          action_ids=act.token_ids, action_logprobs=act.logprobs,
          observation_ids=obs,
          reward=None if rewards is None else rewards[k],
          is_terminal=False, action_sampling_logprobs=act.sampling_logprobs))
    if steps and (self.terminated or self.truncated):
      steps[-1] = dataclasses.replace(steps[-1], is_terminal=True)
    return tuple(prompt), steps

  @classmethod
  def from_steps(cls, prompt_ids: Sequence[int], steps: Sequence[Step], *,
                 reward: float, terminated: bool, truncated: bool,
                 metadata: dict[str, Any] | None = None) -> Trajectory:
    """Builds the trajectory that `to_steps` splits; see there."""
    if any(s.is_terminal for s in steps[:-1]):
      raise ValueError("only the last step can be terminal")
    ended = bool(steps) and steps[-1].is_terminal
    if ended != (terminated or truncated):
      raise ValueError(
          f"last step is_terminal={ended} disagrees with terminated="
          f"{terminated}, truncated={truncated}")
    has_reward = [s.reward is not None for s in steps]
    if any(has_reward) and not all(has_reward):
      raise ValueError("either every step has a reward or none has")
    segments = [Segment(Role.SYSTEM, tuple(prompt_ids))] if prompt_ids else []
    for s in steps:
      segments.append(Segment(Role.ASSISTANT, s.action_ids, s.action_logprobs,
                              s.action_sampling_logprobs))
      if s.observation_ids:
        segments.append(Segment(Role.OBSERVATION, s.observation_ids))
    traj = cls(
        segments=segments, reward=reward,
        turn_rewards=[s.reward for s in steps] if all(has_reward) and steps
        else None,
        terminated=terminated, truncated=truncated,
        metadata=dict(metadata or {}))
    traj.validate()
    return traj


@dataclasses.dataclass(frozen=True)
class Step:
  """One turn: the action the policy sampled and what came back.

  action_ids: the ASSISTANT token ids (including the emitted stop sequence).
  action_logprobs: their rollout log-probs, or None (not sampled).
  observation_ids: the OBSERVATION tokens appended after the action (tool
    output with its wrapper and the next assistant header); may be empty.
  reward: the turn's reward, or None when the trajectory has no turn rewards.
  is_terminal: the episode ended after this step (terminated or truncated).
  action_sampling_logprobs: under the distribution they were drawn from
    (`Segment.sampling_logprobs`); None: the policy itself.
  """

  action_ids: tuple[int, ...]
  action_logprobs: tuple[float, ...] | None
  observation_ids: tuple[int, ...]
  reward: float | None
  is_terminal: bool
  action_sampling_logprobs: tuple[float, ...] | None = None


def truncate_to(traj: Trajectory, max_len: int) -> Trajectory:
  """Returns a copy cut to its first `max_len` tokens, explicitly marked.

  Used when a trajectory is longer than the largest length bucket. The copy
  is `truncated=True`, `terminated=False` (the context budget ran out, the
  task did not end), with `metadata["length_truncated"] = True` and the
  original length and return in `metadata["original_length"]` and
  `["original_reward"]`. It is the episode a context budget of `max_len`
  would have recorded: the rewards of actions cut away entirely are dropped
  with them, from `turn_rewards` and from `reward` alike (without turn
  rewards, `reward` belongs to the last action, as in `turn_arrays`), so
  trajectory- and turn-level credit see one return. The kept actions are not
  credited with what the cut ones earned: as for any truncated episode,
  `mask_truncated` drops its loss and GAE bootstraps the rest.
  """
  if max_len <= 0:
    raise ValueError(f"max_len must be positive, got {max_len}")
  if len(traj) <= max_len:
    return traj
  segments, left = [], max_len
  for seg in traj.segments:
    if left == 0:
      break
    n = min(left, len(seg))
    cut = lambda x: None if x is None else x[:n]
    segments.append(Segment(seg.role, seg.token_ids[:n], cut(seg.logprobs),
                            cut(seg.sampling_logprobs)))
    left -= n
  kept_turns = sum(s.role == Role.ASSISTANT for s in segments)
  if traj.turn_rewards is not None:
    reward = traj.reward - sum(traj.turn_rewards[kept_turns:])
  else:
    reward = traj.reward if kept_turns == traj.num_turns else 0.0
  return Trajectory(
      segments=segments, reward=reward,
      turn_rewards=None if traj.turn_rewards is None
      else list(traj.turn_rewards[:kept_turns]),
      terminated=False, truncated=True,
      metadata={**traj.metadata, "length_truncated": True,
                "original_length": len(traj), "original_reward": traj.reward},
      context_starts=None if traj.context_starts is None
      else list(traj.context_starts[:kept_turns]))


@flax.struct.dataclass
class TokenBatch:
  """Padded, bucketed per-token arrays for one jitted train step.

  All fields are [B, L] and aligned with `tokens` (docs/design.md, convention 1).
  `collate` returns host (numpy) arrays; place them with `jax.device_put`
  (and a sharding) at the jit boundary.
  """

  tokens: jax.Array  # [B, L] int32, pad_id on padding
  loss_mask: jax.Array  # [B, L] float32, 1 on ASSISTANT tokens
  old_logprobs: jax.Array  # [B, L] float32, rollout logprobs (0 off-action)
  # [B, L] float32, log-probs under the distribution each action token was
  # drawn from (`Segment.sampling_logprobs`; 0 off-action): the behaviour
  # policy of "tis"'s importance weights
  sampling_logprobs: jax.Array
  advantages: jax.Array  # [B, L] float32, 0 until credit assignment paints it
  turn_index: jax.Array  # [B, L] int32, k on the k-th action of its trajectory, else -1
  seq_ids: jax.Array  # [B, L] int32, index into collate's input list; -1 on padding
  positions: jax.Array  # [B, L] int32, position within its own sequence (view)
  returns: jax.Array  # [B, L] float32, value targets at turn starts (GAE); else 0
  # [B, L] int32, tree rows (`pack_batch(share_prompts=True)`): on a shared
  # prompt's tokens (seq id -1: in no sequence's loss) and on those of the
  # sequences that continue it, that prompt's number within its row; else -1
  prefix_ids: jax.Array

  @property
  def padding_mask(self) -> jax.Array:
    """[B, L] bool, True on real (non-padding) tokens."""
    return self.seq_ids >= 0


# Every TokenBatch field, with the value `collate` writes on padding.
_PAD_VALUES = {"tokens": 0, "loss_mask": 0.0, "old_logprobs": 0.0,
               "sampling_logprobs": 0.0, "advantages": 0.0,
               "turn_index": -1, "seq_ids": -1, "positions": 0, "returns": 0.0,
               "prefix_ids": -1}
_BATCH_FIELDS = tuple(_PAD_VALUES)


def abstract_batch(rows: int, length: int) -> TokenBatch:
  """A [rows, length] TokenBatch of `jax.ShapeDtypeStruct`s: a step lowered
  on it is compiled for that shape, allocating nothing."""
  return TokenBatch(**{
      f: jax.ShapeDtypeStruct((rows, length), np.int32 if isinstance(v, int) else np.float32)
      for f, v in _PAD_VALUES.items()})


def attention_mask(seq_ids: jax.Array, prefix_ids: jax.Array | None = None) -> jax.Array:
  """Causal mask that never crosses trajectories (packed rows) or padding.

  seq_ids: [B, L] int32 as in `TokenBatch.seq_ids` (-1 on padding).
  prefix_ids: [B, L] int32 as in `TokenBatch.prefix_ids` (tree rows), or
    None: a shared prompt's tokens (seq id -1, prefix id p) attend to one
    another, and the sequences continuing prompt p attend to it too.
  Returns [B, L, L] bool: entry (b, i, j) is True iff token i may attend to
  token j, i.e. j <= i and both belong to the same trajectory (or j to the
  prompt i's trajectory continues). Padding queries attend to nothing
  (their rows are all False).
  """
  length = seq_ids.shape[-1]
  causal = np.tril(np.ones((length, length), bool))
  same = (seq_ids[..., :, None] == seq_ids[..., None, :]) & (seq_ids >= 0)[..., :, None]
  if prefix_ids is not None:
    prompt = (seq_ids < 0) & (prefix_ids >= 0)  # the keys of a shared prompt
    same = same | ((prefix_ids[..., :, None] == prefix_ids[..., None, :])
                   & prompt[..., None, :])
  return same & causal


def bucket_length(length: int, buckets: Sequence[int]) -> int:
  """Smallest bucket >= length; ValueError if none is large enough."""
  fits = [b for b in sorted(buckets) if b >= length]
  if not fits:
    raise ValueError(
        f"a trajectory of {length} tokens is longer than the largest bucket "
        f"({max(buckets)}); add a bucket or cut it explicitly with "
        "trajectory.truncate_to(traj, max_len)")
  return fits[0]


def _pack_rows(lengths: Sequence[int], row_len: int,
               owners: Sequence[int]) -> list[list[int]]:
  """First-fit-decreasing bin packing of sequence indices into rows.

  Sequences with the same owner (views of one trajectory, which share a seq
  id) never share a row, so attention by seq id cannot cross between them.
  """
  rows: list[list[int]] = []
  space: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    for r, free in enumerate(space):
      if lengths[i] <= free and all(owners[j] != owners[i] for j in rows[r]):
        rows[r].append(i)
        space[r] -= lengths[i]
        break
    else:
      rows.append([i])
      space.append(row_len - lengths[i])
  for row in rows:  # keep input order inside a row: easier to read and debug
    row.sort()
  return rows


def collate(trajectories: Sequence[Trajectory], *,
            buckets: Sequence[int] = DEFAULT_BUCKETS, pack: bool = False,
            num_rows: int | None = None, pad_id: int = 0,
            require_logprobs: bool = True) -> TokenBatch:
  """Flattens trajectories into one padded `TokenBatch`.

  Args:
    trajectories: N trajectories. Trajectory i's tokens get `seq_ids == i`,
      which is how per-trajectory or per-turn advantages are painted on later
      (`advantages.broadcast_trajectory_values`, `paint_turn_values`). A
      sliding-window trajectory contributes one sequence per view
      (`Trajectory.flatten_views`), each in its own row and all with seq id
      i, positions restarting at 0 as in the sampler's re-prefilled cache.
    buckets: allowed row lengths L; the smallest one that fits the longest
      trajectory is used, so the jitted step sees few shapes. A trajectory
      longer than every bucket is an error (use `truncate_to` explicitly).
    pack: put several trajectories into one row (first-fit decreasing) when
      they fit; `seq_ids` keeps attention and per-sequence loss aggregation
      apart, `positions` restart at 0 for each trajectory.
    num_rows: pad the batch with empty rows up to exactly this many rows (a
      static B), or raise if more are needed. None: as many as needed.
    pad_id: token id used on padding (masked everywhere).
    require_logprobs: raise if an ASSISTANT segment has no rollout logprobs.
      Pass False for teacher-forced data (SFT); old_logprobs is 0 there.

  Returns:
    A TokenBatch of numpy arrays, [B, L] each; `advantages` and `returns`
    are zeros until credit assignment fills them.
  """
  if not trajectories:
    raise ValueError("collate needs at least one trajectory")
  flats, owners = [], []
  for i, traj in enumerate(trajectories):
    try:
      views = traj.flatten_views()
    except ValueError as e:
      raise ValueError(f"trajectory {i}: {e}") from None
    for flat in views:
      if require_logprobs and not flat.has_logprobs[flat.loss_mask > 0].all():
        raise ValueError(
            f"trajectory {i} has ASSISTANT tokens without rollout logprobs; "
            "pass require_logprobs=False for teacher-forced (SFT) data")
      flats.append(flat)
      owners.append(i)
  lengths = [len(f.ids) for f in flats]
  row_len = bucket_length(max(lengths), buckets)
  rows = (_pack_rows(lengths, row_len, owners) if pack
          else [[i] for i in range(len(flats))])
  n_rows = len(rows) if num_rows is None else num_rows
  if len(rows) > n_rows:
    raise ValueError(f"{len(rows)} rows are needed but num_rows={num_rows}")

  shape = (n_rows, row_len)
  tokens = np.full(shape, pad_id, np.int32)
  loss_mask = np.zeros(shape, np.float32)
  old_logprobs = np.zeros(shape, np.float32)
  sampling_logprobs = np.zeros(shape, np.float32)
  turn_index = np.full(shape, -1, np.int32)
  seq_ids = np.full(shape, -1, np.int32)
  positions = np.zeros(shape, np.int32)
  for r, row in enumerate(rows):
    start = 0
    for i in row:
      f, end = flats[i], start + lengths[i]
      tokens[r, start:end] = f.ids
      loss_mask[r, start:end] = f.loss_mask
      old_logprobs[r, start:end] = f.logprobs
      sampling_logprobs[r, start:end] = f.sampling_logprobs
      turn_index[r, start:end] = f.turn_index
      seq_ids[r, start:end] = owners[i]
      positions[r, start:end] = np.arange(lengths[i])
      start = end
  return TokenBatch(
      tokens=tokens, loss_mask=loss_mask, old_logprobs=old_logprobs,
      sampling_logprobs=sampling_logprobs, advantages=np.zeros(shape, np.float32), turn_index=turn_index,
      seq_ids=seq_ids, positions=positions, returns=np.zeros(shape, np.float32),
      prefix_ids=np.full(shape, -1, np.int32))


def pack_batch(batch: TokenBatch, row_multiple: int = 1, *, share_prompts: bool = False,
               row_length: int | None = None) -> TokenBatch:
  """The sequences of a collated batch, packed into as few rows as fit.

  Sequence packing for the train step: rows of one short episode each are
  mostly padding, which the step's forward and backward still compute.
  Every sequence (a run of one seq id in a row, as `collate` lays them out)
  moves whole, with all its per-token fields, into rows of the same length
  by first-fit decreasing; the views of one sliding-window trajectory
  (rows sharing a seq id) never share a row. Attention (`attention_mask`)
  and the per-sequence loss aggregations read `seq_ids`, so the step's loss
  and gradient are those of the unpacked batch (up to summation order).

  With `share_prompts` (tree rows, AReaL's "tree training"), sequences that
  begin with the same tokens (a group's prompt; the system turn of every
  task) hold those tokens once: the shared prompt, then each sequence's
  rest, its positions going on from the prompt's end; each rest attends to
  the prompt and to itself (`TokenBatch.prefix_ids`). A shared prompt ends
  before the first token in any member's loss, so every loss token is still
  predicted by the state just before it, of the same sequence: the loss and
  gradient are again the unshared batch's. Sequences are grouped greedily
  in token order (members sort next to the sequences they share most with),
  a group growing while the tokens it saves do not shrink and it fits a
  row; views of a sliding-window trajectory are never shared.

  Args:
    batch: a host TokenBatch [B, L] of numpy arrays, not yet packed.
    row_multiple: the row count rounds up to a multiple of this (at least
      one multiple), so the jitted step sees few shapes.
    share_prompts: share common prompts (above).
    row_length: the packed rows' length (>= L); None: L.
  Returns:
    A TokenBatch [B', row_length], B' a multiple of `row_multiple`, its seq
    ids renumbered 0..n-1 in their order (so that they stay below B' x L,
    which `distributed.global_batch` relies on), padding rows as in `collate`.
  """
  if row_multiple < 1:
    raise ValueError(f"row_multiple must be >= 1, got {row_multiple}")
  arrays = {f: np.asarray(getattr(batch, f)) for f in _BATCH_FIELDS}
  if (arrays["prefix_ids"] >= 0).any():
    raise ValueError("the batch is already packed with shared prompts")
  ids = arrays["seq_ids"]
  length = ids.shape[1]
  row_length = row_length or length
  if row_length < length:
    raise ValueError(f"row_length={row_length} < the batch's rows of {length} tokens")
  segments = []  # (row, start, end) of every run of one seq id >= 0
  for r in range(ids.shape[0]):
    cuts = np.flatnonzero(np.diff(ids[r])) + 1
    for start, end in zip(np.r_[0, cuts], np.r_[cuts, length]):
      if ids[r, start] >= 0:
        segments.append((r, int(start), int(end)))
  owners = [int(ids[r, a]) for r, a, _ in segments]
  # Units of one row each: (shared prompt length, member segments).
  units = (_prompt_trees(arrays, segments, owners, row_length) if share_prompts
           else [(0, [i]) for i in range(len(segments))])
  sizes = [p + sum(segments[i][2] - segments[i][1] - p for i in members)
           for p, members in units]
  unit_owners = [owners[m[0]] if len(m) == 1 else -2 - u for u, (_, m) in enumerate(units)]
  rows = _pack_rows(sizes, row_length, unit_owners)
  n_rows = row_multiple * max(1, -(-len(rows) // row_multiple))
  out = {f: np.full((n_rows, row_length), _PAD_VALUES[f], a.dtype)
         for f, a in arrays.items()}

  def put(row, at, r, a, e):
    for f in out:
      out[f][row, at:at + e - a] = arrays[f][r, a:e]
    return at + e - a

  for new_row, row in enumerate(rows):
    at, trees = 0, 0
    for u in row:
      prompt, members = units[u]
      first = at
      if prompt:  # in no sequence: no loss, no seq id
        r, a, _ = segments[members[0]]
        at = put(new_row, at, r, a, a + prompt)
        out["seq_ids"][new_row, first:at] = -1
      for i in members:
        r, a, e = segments[i]
        at = put(new_row, at, r, a + prompt, e)
      if prompt:
        out["prefix_ids"][new_row, first:at] = trees
        trees += 1
  packed = out["seq_ids"]
  dense = np.searchsorted(np.unique(owners), packed)  # owners sorted: their order kept
  out["seq_ids"] = np.where(packed >= 0, dense, -1).astype(np.int32)
  return TokenBatch(**out)


def _prompt_trees(arrays: dict[str, np.ndarray], segments: list[tuple[int, int, int]],
                  owners: list[int], row_length: int) -> list[tuple[int, list[int]]]:
  """`pack_batch`'s units: (shared prompt length, member segments), each
  sharing its members' common first tokens, all before any loss token."""
  counts = collections.Counter(owners)
  tokens = [arrays["tokens"][r, a:e] for r, a, e in segments]
  # A prompt may take the tokens before a member's first loss token but one
  # (so the state predicting that token is the member's own).
  room = []
  for (r, a, e) in segments:
    in_loss = np.flatnonzero(arrays["loss_mask"][r, a:e] > 0)
    room.append(max(0, (in_loss[0] if in_loss.size else e - a) - 1))
  shareable = [i for i in range(len(segments)) if counts[owners[i]] == 1 and room[i] > 0]
  units = [(0, [i]) for i in sorted(set(range(len(segments))) - set(shareable))]
  order = sorted(shareable, key=lambda i: tuple(tokens[i][:room[i]]))

  def common(i, j, limit):
    n = min(limit, len(tokens[i]), len(tokens[j]))
    diff = np.flatnonzero(tokens[i][:n] != tokens[j][:n])
    return int(diff[0]) if diff.size else n

  group, prompt, size = [], 0, 0
  for i in order:
    n = len(tokens[i])
    if group:
      # Sorted: the group's common prefix is its first and last member's.
      p = common(group[0], i, min(prompt, room[i]))
      grown = size + (len(group) - 1) * prompt - len(group) * p + n
      if p > 0 and len(group) * p >= (len(group) - 1) * prompt and grown <= row_length:
        group, prompt, size = group + [i], p, grown
        continue
      units.append((prompt if len(group) > 1 else 0, group))
    group, prompt, size = [i], room[i], n
  if group:
    units.append((prompt if len(group) > 1 else 0, group))
  return units


def turn_arrays(trajectories: Sequence[Trajectory], num_turns: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
  """Stacks per-turn rewards for the turn-level credit assignment functions.

  Returns (turn_rewards float32[N, T], turn_mask float32[N, T]), where T is
  `num_turns` (pass a fixed value so the jitted estimators see one shape) or
  the largest number of turns. Trajectories without `turn_rewards` get
  `reward` on their last turn (a sparse, terminal-only reward).
  """
  counts = [t.num_turns for t in trajectories]
  width = max(counts) if num_turns is None else num_turns
  if max(counts) > width:
    raise ValueError(f"a trajectory has {max(counts)} turns > num_turns={width}")
  rewards = np.zeros((len(trajectories), width), np.float32)
  mask = np.zeros((len(trajectories), width), np.float32)
  for i, (traj, n) in enumerate(zip(trajectories, counts)):
    traj.validate()
    mask[i, :n] = 1.0
    if traj.turn_rewards is not None:
      rewards[i, :n] = traj.turn_rewards
    elif n:
      rewards[i, n - 1] = traj.reward
  return rewards, mask
