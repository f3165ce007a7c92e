"""Tests for agentrl_jax.trajectory: flatten, steps, collate, packing."""

import dataclasses
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import advantages, losses, trajectory
from agentrl_jax.trajectory import (
    Role, Segment, Step, Trajectory, TokenBatch, attention_mask, bucket_length, collate,
    pack_batch, truncate_to, turn_arrays)


def exercise6_traj() -> Trajectory:
  """The reference text's exercise 6: S=3, A=2, O=4, A=2 (11 tokens)."""
  return Trajectory([
      Segment(Role.SYSTEM, [10, 11, 12]),
      Segment(Role.ASSISTANT, [20, 21], [-0.1, -0.2]),
      Segment(Role.OBSERVATION, [30, 31, 32, 33]),
      Segment(Role.ASSISTANT, [40, 41], [-0.3, -0.4]),
  ], reward=1.0, turn_rewards=[0.0, 1.0], terminated=True)


def test_exercise6_flatten_by_hand():
  # index : 0 1 2 | 3 4 | 5 6 7 8 | 9 10
  # role  : S S S | A A | O O O O | A A
  # mask  : 0 0 0 | 1 1 | 0 0 0 0 | 1 1   -> 4 action tokens
  flat = exercise6_traj().flatten_all()
  np.testing.assert_array_equal(
      flat.ids, [10, 11, 12, 20, 21, 30, 31, 32, 33, 40, 41])
  assert flat.ids.dtype == np.int32 and flat.loss_mask.dtype == np.float32
  np.testing.assert_array_equal(flat.loss_mask, [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(
      flat.turn_index, [-1, -1, -1, 0, 0, -1, -1, -1, -1, 1, 1])
  np.testing.assert_allclose(
      flat.logprobs, [0, 0, 0, -.1, -.2, 0, 0, 0, 0, -.3, -.4], rtol=1e-6)
  ids, mask = exercise6_traj().flatten()
  np.testing.assert_array_equal(ids, flat.ids)
  assert mask.sum() == 4


def _reference_shifted_masked_sum(logits, tokens, mask):
  """The reference text's convention: logits[:-1] predict tokens[1:], mask[1:]."""
  z = logits[:, :-1].astype(np.float64)
  logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - z.max(-1, keepdims=True)
  tgt = np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  return (tgt * mask[:, 1:]).sum(), mask[:, 1:].sum()


def test_exercise6_through_collate_and_token_logprobs():
  batch = collate([exercise6_traj()], buckets=(16,))
  # Padded to the 16 bucket: the mask keeps its 4 ones, padding is 0.
  assert batch.tokens.shape == (1, 16)
  np.testing.assert_array_equal(
      batch.loss_mask[0], [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(batch.seq_ids[0, 11:], -1)
  # After the next-token shift the reference counts the same 4 live tokens
  # (mask[1:] = 0 0 1 1 0 0 0 0 1 1): position 0 is never an action.
  assert batch.loss_mask[0, 1:].sum() == 4
  logits = np.random.default_rng(0).normal(size=(1, 16, 64)).astype(np.float32)
  lp = np.asarray(losses.token_logprobs(jnp.asarray(logits), batch.tokens))
  # Our aligned log-probs at action positions are exactly the reference's
  # shifted ones: e.g. token 20 at index 3 is predicted by logits[:, 2].
  for i in (3, 4, 9, 10):
    z = logits[0, i - 1].astype(np.float64)
    want = z[batch.tokens[0, i]] - np.log(np.exp(z).sum())
    np.testing.assert_allclose(lp[0, i], want, atol=1e-5)
  ours = (lp * batch.loss_mask).sum()
  ref, ref_count = _reference_shifted_masked_sum(logits, batch.tokens,
                                                 batch.loss_mask)
  assert ref_count == 4
  np.testing.assert_allclose(ours, ref, rtol=1e-5)
  # The rollout logprobs sit on the same positions as the mask.
  np.testing.assert_allclose(batch.old_logprobs[0, [3, 4, 9, 10]],
                             [-.1, -.2, -.3, -.4], rtol=1e-6)


# -- Validation ---------------------------------------------------------------

def test_segment_validation():
  with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
    Segment(Role.ASSISTANT, [1, 2], [-0.5])
  with pytest.raises(ValueError, match="only ASSISTANT"):
    Segment(Role.OBSERVATION, [1], [-0.5])
  with pytest.raises(ValueError, match="finite"):
    Segment(Role.ASSISTANT, [1], [float("nan")])
  with pytest.raises(ValueError, match="not probabilities"):
    Segment(Role.ASSISTANT, [1, 2], [0.3, 0.7])
  with pytest.raises(ValueError, match="token ids"):
    Segment(Role.SYSTEM, [-1])
  with pytest.raises(TypeError, match="Role"):
    Segment("assistant", [1])
  with pytest.raises(ValueError, match="2 tokens but 1 sampling_logprobs"):
    Segment(Role.ASSISTANT, [1, 2], [-0.5, -0.1], [-0.5])
  with pytest.raises(ValueError, match="sampling_logprobs without logprobs"):
    Segment(Role.ASSISTANT, [1], None, [-0.5])


def test_sampling_logprobs_travel_with_their_tokens():
  # Turn 0 drawn from a filtered distribution, turn 1 from the policy itself
  # (no sampling log-probs: the policy's stand in).
  traj = Trajectory([Segment(Role.SYSTEM, [1, 2]),
                     Segment(Role.ASSISTANT, [3, 4], [-1.0, -2.0], [-0.5, -0.25]),
                     Segment(Role.OBSERVATION, [5]),
                     Segment(Role.ASSISTANT, [6], [-3.0])], reward=1.0)
  batch = collate([traj], buckets=(8,))
  np.testing.assert_array_equal(batch.old_logprobs[0], [0, 0, -1, -2, 0, -3, 0, 0])
  np.testing.assert_array_equal(batch.sampling_logprobs[0],
                                [0, 0, -0.5, -0.25, 0, -3, 0, 0])
  cut = trajectory.truncate_to(traj, 3)
  assert cut.segments[1].sampling_logprobs == (-0.5,)
  prompt, steps = traj.to_steps()
  back = Trajectory.from_steps(prompt, steps, reward=1.0, terminated=False, truncated=False)
  assert back.segments == traj.segments


@pytest.mark.parametrize("traj, match", [
    (Trajectory([]), "empty trajectory"),
    (Trajectory([Segment(Role.SYSTEM, [])]), "empty trajectory"),
    (Trajectory([Segment(Role.SYSTEM, [1])], reward=float("nan")), "finite"),
    (Trajectory([Segment(Role.SYSTEM, [1])], reward=float("inf")), "finite"),
    (Trajectory([Segment(Role.ASSISTANT, [1], [-1.0])],
                turn_rewards=[float("-inf")]), "turn rewards must be finite"),
    (Trajectory([Segment(Role.ASSISTANT, [1], [-1.0])], turn_rewards=[1, 2]),
     "2 entries but the trajectory has 1"),
    (Trajectory([Segment(Role.SYSTEM, [1])], terminated=True, truncated=True),
     "not both"),
])
def test_trajectory_validation(traj, match):
  with pytest.raises(ValueError, match=match):
    traj.flatten()
  with pytest.raises(ValueError, match=match):
    collate([exercise6_traj(), traj])


def test_collate_requires_logprobs_unless_told_otherwise():
  sft = Trajectory([Segment(Role.SYSTEM, [1, 2]), Segment(Role.ASSISTANT, [3, 4])])
  with pytest.raises(ValueError, match="require_logprobs=False"):
    collate([sft])
  batch = collate([sft], require_logprobs=False, buckets=(8,))
  np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(batch.old_logprobs, 0)


def test_overlong_is_an_error_and_truncation_is_explicit():
  traj = exercise6_traj()
  with pytest.raises(ValueError, match="longer than the largest bucket"):
    collate([traj], buckets=(4, 8))
  cut = truncate_to(traj, 8)  # S S S A A O O O: the second action is gone
  assert len(cut) == 8 and cut.truncated and not cut.terminated
  assert cut.metadata["length_truncated"] and cut.metadata["original_length"] == 11
  assert cut.turn_rewards == [0.0] and cut.num_turns == 1
  batch = collate([cut], buckets=(4, 8))
  np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 0, 1, 1, 0, 0, 0])
  cut4 = truncate_to(traj, 4)  # cuts inside the first action: logprobs follow
  assert cut4.segments[-1].logprobs == (-0.1,)
  assert truncate_to(traj, 11) is traj


def test_a_cut_trajectory_earns_what_its_kept_actions_earned():
  # exercise6: turn rewards [0, 1], return 1. Cut at 8 tokens the second
  # action is gone with its reward: return 0 at both levels, like an
  # episode the context budget cut there.
  cut = truncate_to(exercise6_traj(), 8)
  assert cut.reward == 0.0 and cut.metadata["original_reward"] == 1.0
  rewards, _ = turn_arrays([cut])
  assert rewards.sum() == cut.reward
  # Turn rewards [0.5, 2], return 2.5: the return loses what the cut actions
  # earned; one cut inside (10 tokens) is kept, with its reward.
  traj = exercise6_traj()
  traj.reward, traj.turn_rewards = 2.5, [0.5, 2.0]
  assert truncate_to(traj, 8).reward == 0.5 and truncate_to(traj, 10).reward == 2.5
  # Without turn rewards, the return sits on the last action (`turn_arrays`):
  # kept while that action is, dropped with it.
  traj = exercise6_traj()
  traj.turn_rewards = None
  assert truncate_to(traj, 10).reward == 1.0 and truncate_to(traj, 8).reward == 0.0


# -- Step records ---------------------------------------------------------------

@st.composite
def canonical_trajectories(draw):
  ids = st.lists(st.integers(0, 1000), min_size=1, max_size=5)
  prompt = draw(st.lists(st.integers(0, 1000), max_size=4))
  n_turns = draw(st.integers(0 if prompt else 1, 4))
  sampled = draw(st.booleans())
  dense = draw(st.booleans())
  ended = draw(st.sampled_from(["terminated", "truncated", "running"]))
  segments = [Segment(Role.SYSTEM, prompt)] if prompt else []
  for k in range(n_turns):
    act = draw(ids)
    lps = [-draw(st.floats(0, 10)) for _ in act] if sampled else None
    segments.append(Segment(Role.ASSISTANT, act, lps))
    if draw(st.booleans()):
      segments.append(Segment(Role.OBSERVATION, draw(ids)))
  rewards = [draw(st.floats(-1, 1)) for _ in range(n_turns)]
  return Trajectory(
      segments, reward=draw(st.floats(-1, 1)),
      turn_rewards=rewards if dense and n_turns else None,
      terminated=ended == "terminated" and n_turns > 0,
      truncated=ended == "truncated" and n_turns > 0,
      metadata={"task": draw(st.integers())})


@hypothesis.given(canonical_trajectories())
@hypothesis.settings(max_examples=200, deadline=None)
def test_steps_round_trip_is_lossless(traj):
  prompt, steps = traj.to_steps()
  assert len(steps) == traj.num_turns
  back = Trajectory.from_steps(
      prompt, steps, reward=traj.reward, terminated=traj.terminated,
      truncated=traj.truncated, metadata=traj.metadata)
  assert back == traj
  np.testing.assert_array_equal(back.flatten()[0], traj.flatten()[0])


def test_steps_by_hand():
  prompt, steps = exercise6_traj().to_steps()
  assert prompt == (10, 11, 12)
  assert steps == [
      Step((20, 21), (-0.1, -0.2), (30, 31, 32, 33), 0.0, False),
      Step((40, 41), (-0.3, -0.4), (), 1.0, True)]


def test_to_steps_rejects_non_canonical_layout():
  traj = Trajectory([Segment(Role.SYSTEM, [1]), Segment(Role.OBSERVATION, [2]),
                     Segment(Role.ASSISTANT, [3], [-1.0])])
  with pytest.raises(ValueError, match="found OBSERVATION"):
    traj.to_steps()
  step = Step((1,), None, (), None, True)
  with pytest.raises(ValueError, match="only the last step"):
    Trajectory.from_steps([], [step, step], reward=0.0, terminated=True,
                          truncated=False)
  with pytest.raises(ValueError, match="disagrees"):
    Trajectory.from_steps([], [step], reward=0.0, terminated=False,
                          truncated=False)


# -- Collate, buckets, packing ----------------------------------------------------

def _random_traj(rng, n_turns, max_seg=6, sampled=True):
  segs = [Segment(Role.SYSTEM, rng.integers(0, 50, rng.integers(1, max_seg)))]
  for _ in range(n_turns):
    act = rng.integers(0, 50, rng.integers(1, max_seg))
    segs.append(Segment(Role.ASSISTANT, act,
                        -rng.uniform(0, 3, len(act)) if sampled else None))
    segs.append(Segment(Role.OBSERVATION, rng.integers(0, 50, rng.integers(1, max_seg))))
  return Trajectory(segs, reward=float(rng.uniform()),
                    turn_rewards=list(rng.uniform(size=n_turns)), terminated=True)


def test_bucket_length():
  assert bucket_length(1, (8, 4)) == 4
  assert bucket_length(5, (8, 4)) == 8
  with pytest.raises(ValueError, match="largest bucket"):
    bucket_length(9, (8, 4))


def test_collate_num_rows_pads_with_empty_rows():
  trajs = [exercise6_traj(), exercise6_traj()]
  batch = collate(trajs, buckets=(16,), num_rows=4)
  assert batch.tokens.shape == (4, 16)
  np.testing.assert_array_equal(batch.seq_ids[2:], -1)
  np.testing.assert_array_equal(batch.loss_mask[2:], 0)
  with pytest.raises(ValueError, match="2 rows are needed but num_rows=1"):
    collate(trajs, buckets=(16,), num_rows=1)


@hypothesis.given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.booleans())
@hypothesis.settings(max_examples=60, deadline=None)
def test_collate_keeps_every_token_in_place(seed, n, pack):
  rng = np.random.default_rng(seed)
  trajs = [_random_traj(rng, int(rng.integers(1, 4))) for _ in range(n)]
  batch = collate(trajs, buckets=(32, 64), pack=pack)
  rows = batch.tokens.shape[0]
  assert rows == n if not pack else rows <= n
  for i, traj in enumerate(trajs):
    flat = traj.flatten_all()
    where = batch.seq_ids == i
    r = np.unique(np.nonzero(where)[0])
    assert len(r) == 1, "a trajectory never spans rows"
    cols = np.nonzero(where[r[0]])[0]
    assert np.all(np.diff(cols) == 1), "a trajectory is contiguous"
    np.testing.assert_array_equal(batch.tokens[where], flat.ids)
    np.testing.assert_array_equal(batch.loss_mask[where], flat.loss_mask)
    np.testing.assert_array_equal(batch.turn_index[where], flat.turn_index)
    np.testing.assert_array_equal(batch.old_logprobs[where], flat.logprobs)
    np.testing.assert_array_equal(batch.positions[where], np.arange(len(flat.ids)))
  pad = batch.seq_ids < 0
  assert np.all(batch.loss_mask[pad] == 0) and np.all(batch.turn_index[pad] == -1)
  assert (~pad).sum() == sum(len(t) for t in trajs)


def test_packing_by_hand():
  a = Trajectory([Segment(Role.SYSTEM, [1] * 5), Segment(Role.ASSISTANT, [2] * 5, [-1.] * 5)])
  b = Trajectory([Segment(Role.SYSTEM, [3] * 3), Segment(Role.ASSISTANT, [4] * 3, [-1.] * 3)])
  c = Trajectory([Segment(Role.SYSTEM, [5] * 2), Segment(Role.ASSISTANT, [6] * 2, [-1.] * 2)])
  # Lengths 10, 6, 4 into rows of 10 (first fit decreasing): [a], [b, c].
  batch = collate([a, b, c], buckets=(10,), pack=True)
  np.testing.assert_array_equal(batch.seq_ids, [[0] * 10, [1] * 6 + [2] * 4])
  np.testing.assert_array_equal(batch.positions[1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3])


def _painted(batch):
  """`batch` with advantages and returns that name each token's sequence
  and position (and padding rows), so a moved token shows where it came from."""
  real = batch.seq_ids >= 0
  return batch.replace(
      advantages=np.where(real, batch.seq_ids * 100.0 + batch.positions, 0).astype(np.float32),
      returns=np.where(real, -batch.seq_ids - 0.5, 0).astype(np.float32))


def test_pack_batch_by_hand():
  a = Trajectory([Segment(Role.SYSTEM, [1] * 5), Segment(Role.ASSISTANT, [2] * 5, [-1.] * 5)])
  b = Trajectory([Segment(Role.SYSTEM, [3] * 3), Segment(Role.ASSISTANT, [4] * 3, [-1.] * 3)])
  c = Trajectory([Segment(Role.SYSTEM, [5] * 2), Segment(Role.ASSISTANT, [6] * 2, [-1.] * 2)])
  # One per row with a padding row (as the RL trainer collates), lengths
  # 10, 6, 4 -> rows of 10 by first fit decreasing: [a], [b, c].
  batch = _painted(collate([a, b, c], buckets=(10,), num_rows=4))
  packed = pack_batch(batch)
  np.testing.assert_array_equal(packed.seq_ids, [[0] * 10, [1] * 6 + [2] * 4])
  np.testing.assert_array_equal(packed.tokens[1], [3, 3, 3, 4, 4, 4, 5, 5, 6, 6])
  np.testing.assert_array_equal(packed.positions[1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
  np.testing.assert_array_equal(packed.loss_mask[1], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1])
  np.testing.assert_array_equal(packed.advantages[1], [100, 101, 102, 103, 104, 105,
                                                       200, 201, 202, 203])
  np.testing.assert_array_equal(packed.returns[1], [-1.5] * 6 + [-2.5] * 4)
  # The same rows as collate's own packing of the trajectories.
  direct = collate([a, b, c], buckets=(10,), pack=True)
  for name in ("tokens", "loss_mask", "old_logprobs", "turn_index", "seq_ids", "positions"):
    np.testing.assert_array_equal(getattr(packed, name), getattr(direct, name), err_msg=name)
  # Rounded up to a multiple of 4 rows, the new ones all padding.
  four = pack_batch(batch, row_multiple=4)
  assert four.tokens.shape == (4, 10)
  np.testing.assert_array_equal(four.seq_ids[2:], -1)
  np.testing.assert_array_equal(four.turn_index[2:], -1)
  np.testing.assert_array_equal(four.loss_mask[2:], 0)
  # A filtered batch (b's row gone) keeps the order of its ids, now dense.
  kept = jax.tree.map(lambda x: x[[0, 2]], batch)
  np.testing.assert_array_equal(pack_batch(kept).seq_ids, [[0] * 10, [1] * 4 + [-1] * 6])
  with pytest.raises(ValueError, match="row_multiple"):
    pack_batch(batch, row_multiple=0)


def test_pack_batch_keeps_the_views_of_a_trajectory_in_separate_rows():
  small = Trajectory(windowed_traj().segments[:3], 1.0, context_starts=[1])
  batch = _painted(collate([windowed_traj(), small, exercise6_traj()], buckets=(16,)))
  assert batch.tokens.shape[0] == 4  # two views of the first, one row each after
  packed = pack_batch(batch)
  for ids, positions in zip(packed.seq_ids, packed.positions):
    starts = ids[(ids >= 0) & (positions == 0)]  # each view starts at position 0
    assert len(starts) == len(set(starts)), "one view per trajectory per row"
  assert packed.tokens.shape[0] == 3 < batch.tokens.shape[0]
  # Every token, with every field, once: the multiset of (id, position,
  # fields) is unchanged (ids are unchanged here: none was dropped).
  def tokens_of(b):
    real = b.seq_ids >= 0
    cols = [b.seq_ids, b.positions, b.tokens, b.loss_mask, b.old_logprobs, b.advantages,
            b.turn_index, b.returns]
    return sorted(zip(*(np.asarray(c)[real].tolist() for c in cols)))
  assert tokens_of(packed) == tokens_of(batch)


@hypothesis.given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(1, 5))
@hypothesis.settings(max_examples=40, deadline=None)
def test_pack_batch_moves_whole_sequences_and_matches_collate(seed, n, multiple):
  rng = np.random.default_rng(seed)
  trajs = [_random_traj(rng, int(rng.integers(1, 4))) for _ in range(n)]
  batch = _painted(collate(trajs, buckets=(32, 64)))
  packed = pack_batch(batch, multiple)
  direct = collate(trajs, buckets=(32, 64), pack=True)
  assert packed.tokens.shape[0] % multiple == 0
  assert packed.tokens.shape[0] - multiple < direct.tokens.shape[0] <= packed.tokens.shape[0]
  rows = direct.tokens.shape[0]
  for name in ("tokens", "loss_mask", "old_logprobs", "turn_index", "seq_ids", "positions"):
    np.testing.assert_array_equal(getattr(packed, name)[:rows], getattr(direct, name),
                                  err_msg=name)
  real = packed.seq_ids >= 0
  np.testing.assert_array_equal(packed.advantages[real],
                                packed.seq_ids[real] * 100.0 + packed.positions[real])
  assert not real[rows:].any()


def test_pad_values_name_every_batch_field():
  assert set(trajectory._PAD_VALUES) == {f.name for f in dataclasses.fields(TokenBatch)}


def test_attention_mask_never_crosses_trajectories():
  seq_ids = np.array([[0, 0, 1, 1, 1, -1]])
  mask = np.asarray(attention_mask(seq_ids))[0]
  want = np.array([
      [1, 0, 0, 0, 0, 0],
      [1, 1, 0, 0, 0, 0],
      [0, 0, 1, 0, 0, 0],
      [0, 0, 1, 1, 0, 0],
      [0, 0, 1, 1, 1, 0],
      [0, 0, 0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(mask, want)


def test_attention_mask_of_a_tree_row_by_hand():
  # A shared prompt (2 tokens), the rests of sequences 0 and 1, sequence 2
  # on its own, padding.
  seq_ids = np.array([[-1, -1, 0, 0, 1, 1, 1, 2, 2, -1]])
  prefix_ids = np.array([[0, 0, 0, 0, 0, 0, 0, -1, -1, -1]])
  mask = np.asarray(attention_mask(seq_ids, prefix_ids))[0]
  want = np.array([
      [1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
      [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
      [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
      [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
      [1, 1, 0, 0, 1, 0, 0, 0, 0, 0],
      [1, 1, 0, 0, 1, 1, 0, 0, 0, 0],
      [1, 1, 0, 0, 1, 1, 1, 0, 0, 0],
      [0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
      [0, 0, 0, 0, 0, 0, 0, 1, 1, 0],
      [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(mask, want)
  np.testing.assert_array_equal(np.asarray(attention_mask(seq_ids, np.full_like(seq_ids, -1))),
                                np.asarray(attention_mask(seq_ids)))


def _prompted(prompt, rest_ids, first_action=1):
  """A trajectory: `prompt` (system), then `first_action` observation
  tokens of the rest, then its first action and the remaining tokens."""
  obs, act = rest_ids[:first_action], rest_ids[first_action:]
  return Trajectory([Segment(Role.SYSTEM, prompt + obs),
                     Segment(Role.ASSISTANT, act, [-0.5] * len(act))], reward=1.0)


def test_pack_batch_shares_prompts_by_hand():
  sys_ = [7, 7, 7]
  a = _prompted(sys_ + [1, 1], [9, 20, 21])  # prompt 7 7 7 1 1 9, actions 20 21
  b = _prompted(sys_ + [1, 1], [9, 30])
  c = _prompted(sys_ + [2], [9, 40, 41])  # another task, the same system turn
  d = Trajectory([Segment(Role.SYSTEM, [5]), Segment(Role.ASSISTANT, [6], [-0.5])], 1.0)
  batch = _painted(collate([a, b, c, d], buckets=(8,), num_rows=5))
  tree = pack_batch(batch, share_prompts=True, row_length=16)
  # a and b share 7 7 7 1 1 (the tokens before their first action but one);
  # c joins them on 7 7 7: the group saves 2 x 3 = 6 >= 1 x 5 tokens.
  # Sorted by their prompts: a, b (7 7 7 1 1 ...), then c (7 7 7 2 ...).
  np.testing.assert_array_equal(tree.tokens[0], [7, 7, 7, 1, 1, 9, 20, 21, 1, 1, 9, 30, 2, 9,
                                                 40, 41])
  np.testing.assert_array_equal(tree.seq_ids[0], [-1] * 3 + [0] * 5 + [1] * 4 + [2] * 4)
  np.testing.assert_array_equal(tree.prefix_ids[0], [0] * 16)
  np.testing.assert_array_equal(tree.positions[0], [0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 6,
                                                    3, 4, 5, 6])
  np.testing.assert_array_equal(tree.loss_mask[0], [0] * 6 + [1, 1] + [0, 0, 0, 1]
                                + [0, 0, 1, 1])
  # Each token's other fields came with it (painted: seq id x 100 + position).
  real = tree.seq_ids >= 0
  np.testing.assert_array_equal(tree.advantages[real],
                                tree.seq_ids[real] * 100.0 + tree.positions[real])
  np.testing.assert_array_equal(tree.advantages[0, :3], [0, 1, 2])  # a's, in no loss
  # d shares nothing: alone, as pack_batch lays it out.
  np.testing.assert_array_equal(tree.seq_ids[1], [3, 3] + [-1] * 14)
  np.testing.assert_array_equal(tree.prefix_ids[1], [-1] * 16)
  assert tree.tokens.shape == (2, 16)
  with pytest.raises(ValueError, match="already packed"):
    pack_batch(tree, share_prompts=True)
  with pytest.raises(ValueError, match="row_length"):
    pack_batch(batch, row_length=4)
  # Rows of 8 hold no group (a and b together take 8 + 7 - 5 = 10): none shares.
  small = pack_batch(batch, share_prompts=True, row_length=8)
  np.testing.assert_array_equal(small.prefix_ids.max(axis=1) >= 0,
                                [False] * small.tokens.shape[0])


def test_pack_batch_never_shares_a_sliding_window_view():
  prompt = [1, 2]
  trajs = [windowed_traj(), _prompted(prompt, [3, 20]), _prompted(prompt, [3, 30])]
  batch = _painted(collate(trajs, buckets=(16,)))
  tree = pack_batch(batch, share_prompts=True)
  shared = np.unique(tree.seq_ids[tree.prefix_ids >= 0])
  np.testing.assert_array_equal(shared, [-1, 1, 2])


def test_turn_arrays():
  t1 = exercise6_traj()  # dense: [0, 1]
  t2 = Trajectory([Segment(Role.ASSISTANT, [1], [-1.0])], reward=0.5)  # sparse
  rewards, mask = turn_arrays([t1, t2], num_turns=3)
  np.testing.assert_allclose(rewards, [[0, 1, 0], [0.5, 0, 0]])
  np.testing.assert_array_equal(mask, [[1, 1, 0], [1, 0, 0]])
  with pytest.raises(ValueError, match="num_turns=1"):
    turn_arrays([t1], num_turns=1)


# -- Packed and padded batches give the same loss -------------------------------

def _toy_context_model(params, batch):
  """A causal 'model' whose logits depend on everything it may attend to.

  h_i = sum_j attn(i, j) (E[tok_j] + P[pos_j]) / (1 + pos_i); logits = h W.
  It respects `attention_mask` and `positions`, exactly what a packed batch
  needs from the real model; one leaked token changes the logits.
  """
  emb, pos, out = params
  x = emb[batch.tokens] + pos[batch.positions]
  h = jnp.einsum("bij,bjd->bid", attention_mask(batch.seq_ids).astype(x.dtype), x)
  h = h / (1.0 + batch.positions[..., None])
  return jnp.tanh(h) @ out


def _loss(params, batch, group_ids, agg, model=_toy_context_model):
  logp = losses.token_logprobs(model(params, batch), batch.tokens)
  rewards = jnp.asarray([0.0, 1.0, 0.5, 1.0, 0.0])
  adv = advantages.broadcast_trajectory_values(
      advantages.grpo_advantages(rewards, group_ids), batch.seq_ids,
      batch.turn_index)
  loss, _ = losses.policy_loss(
      logp, batch.old_logprobs, adv, batch.loss_mask, agg=agg,
      norm_constant=64.0, seq_ids=batch.seq_ids)
  return loss


@pytest.mark.parametrize("agg", losses.LOSS_AGG_MODES)
def test_packed_padded_and_unpacked_batches_give_the_same_loss(agg):
  rng = np.random.default_rng(7)
  trajs = [_random_traj(rng, int(rng.integers(1, 4)), max_seg=5) for _ in range(5)]
  group_ids = jnp.asarray([0, 0, 0, 1, 1])
  k = jax.random.split(jax.random.key(0), 3)
  params = (jax.random.normal(k[0], (50, 8)), jax.random.normal(k[1], (64, 8)),
            jax.random.normal(k[2], (8, 50)))
  unpacked = collate(trajs, buckets=(32,))
  padded = collate(trajs, buckets=(64,), num_rows=7)
  packed = collate(trajs, buckets=(64,), pack=True)
  assert packed.tokens.shape[0] < len(trajs)
  want = _loss(params, unpacked, group_ids, agg)
  np.testing.assert_allclose(_loss(params, padded, group_ids, agg), want, rtol=1e-5)
  np.testing.assert_allclose(_loss(params, packed, group_ids, agg), want, rtol=1e-5)
  grads = [jax.grad(_loss)(params, b, group_ids, agg) for b in (unpacked, packed)]
  for g_unpacked, g_packed in zip(*grads):
    np.testing.assert_allclose(g_packed, g_unpacked, rtol=1e-4, atol=1e-6)
  if agg != "token-mean":
    # Aggregating a packed batch per row instead of per trajectory differs:
    # seq_ids are what make the per-sequence modes right.
    logp = losses.token_logprobs(_toy_context_model(params, packed), packed.tokens)
    per_row, _ = losses.policy_loss(
        logp, packed.old_logprobs, packed.loss_mask, packed.loss_mask, agg=agg,
        norm_constant=64.0)
    per_traj, _ = losses.policy_loss(
        logp, packed.old_logprobs, packed.loss_mask, packed.loss_mask, agg=agg,
        norm_constant=64.0, seq_ids=packed.seq_ids)
    assert not math.isclose(float(per_row), float(per_traj), rel_tol=1e-3)


def test_packed_loss_differs_if_attention_leaks():
  """The packing test above can fail: a model ignoring seq_ids changes it."""
  rng = np.random.default_rng(7)
  trajs = [_random_traj(rng, int(rng.integers(1, 4)), max_seg=5) for _ in range(5)]
  k = jax.random.split(jax.random.key(0), 3)
  params = (jax.random.normal(k[0], (50, 8)), jax.random.normal(k[1], (64, 8)),
            jax.random.normal(k[2], (8, 50)))

  def leaky(params, batch):  # plain causal mask over the whole row
    row = jnp.where(batch.seq_ids >= 0, 0, -1)
    return _toy_context_model(params, batch.replace(seq_ids=row))

  group_ids = jnp.asarray([0, 0, 0, 1, 1])
  packed = collate(trajs, buckets=(64,), pack=True)
  want = _loss(params, collate(trajs, buckets=(32,)), group_ids, "token-mean")
  got = _loss(params, packed, group_ids, "token-mean", model=leaky)
  assert not math.isclose(float(got), float(want), rel_tol=1e-4)


def windowed_traj() -> Trajectory:
  """S=2, then 3 turns (A=2, O=1 each); action 2 saw only the prompt + turn 1."""
  segs = [Segment(Role.SYSTEM, [1, 2])]
  for k in range(3):
    segs.append(Segment(Role.ASSISTANT, [10 * k + 10, 10 * k + 11], [-0.1 * k - 0.1] * 2))
    segs.append(Segment(Role.OBSERVATION, [10 * k + 15]))
  return Trajectory(segs, reward=1.0, turn_rewards=[0.0, 0.5, 1.0], terminated=True,
                    context_starts=[1, 1, 3])


def test_sliding_window_views_by_hand():
  traj = windowed_traj()
  first, second = traj.flatten_views()
  assert traj.num_views == 2
  # View 0: S S | A0 A0 | O0 | A1 A1   (the last view's trailing obs O1 is not here)
  np.testing.assert_array_equal(first.ids, [1, 2, 10, 11, 15, 20, 21])
  np.testing.assert_array_equal(first.loss_mask, [0, 0, 1, 1, 0, 1, 1])
  np.testing.assert_array_equal(first.turn_index, [-1, -1, 0, 0, -1, 1, 1])
  # View 1: S S | A1 A1 (context now) | O1 | A2 A2 | O2 (runs to the end)
  np.testing.assert_array_equal(second.ids, [1, 2, 20, 21, 25, 30, 31, 35])
  np.testing.assert_array_equal(second.loss_mask, [0, 0, 0, 0, 0, 1, 1, 0])
  np.testing.assert_array_equal(second.turn_index, [-1, -1, -1, -1, -1, 2, 2, -1])
  np.testing.assert_allclose(second.logprobs, [0, 0, 0, 0, 0, -.3, -.3, 0], rtol=1e-6)
  np.testing.assert_array_equal(second.has_logprobs, second.loss_mask > 0)
  # Each action is trained exactly once over all views.
  total = sum(v.loss_mask.sum() for v in traj.flatten_views())
  assert total == traj.flatten_all().loss_mask.sum() == 6
  # With the final state's own window (the extra entry): the last action's
  # view stops at it, and a view with nothing trained holds the final state.
  boot = Trajectory(traj.segments, 1.0, context_starts=[1, 1, 3, 5])
  views = boot.flatten_views()
  assert boot.num_views == len(views) == 3
  np.testing.assert_array_equal(views[1].ids, [1, 2, 20, 21, 25, 30, 31])
  np.testing.assert_array_equal(views[2].ids, [1, 2, 30, 31, 35])
  assert views[2].loss_mask.sum() == 0 and (views[2].turn_index == -1).all()
  assert sum(v.loss_mask.sum() for v in views) == 6
  # An extra entry equal to the last action's adds nothing.
  assert Trajectory(traj.segments, 1.0, context_starts=[1, 1, 3, 3]).num_views == 2
  # An all-prompt window is the append-only trajectory.
  whole = Trajectory(traj.segments, 1.0, context_starts=[1, 1, 1])
  (only,) = whole.flatten_views()
  np.testing.assert_array_equal(only.ids, whole.flatten_all().ids)
  np.testing.assert_array_equal(only.loss_mask, whole.flatten_all().loss_mask)


def test_sliding_window_collate_rows_seq_ids_and_painting():
  trajs = [windowed_traj(), exercise6_traj()]
  batch = collate(trajs, buckets=(8, 16))
  assert batch.tokens.shape == (3, 16)  # two views + one trajectory, one row each
  np.testing.assert_array_equal(batch.seq_ids[:, 0], [0, 0, 1])
  np.testing.assert_array_equal(batch.positions[1, :8], np.arange(8))
  np.testing.assert_array_equal(batch.tokens[1, :8], [1, 2, 20, 21, 25, 30, 31, 35])
  # Per-turn values land on each action in the view it was sampled in.
  turn_values = jnp.asarray([[1.0, 2.0, 3.0], [7.0, 8.0, 0.0]])
  painted = np.asarray(advantages.paint_turn_values(
      turn_values, jnp.asarray(batch.seq_ids), jnp.asarray(batch.turn_index)))
  np.testing.assert_array_equal(painted[0, :7], [0, 0, 1, 1, 0, 2, 2])
  np.testing.assert_array_equal(painted[1, :8], [0, 0, 0, 0, 0, 3, 3, 0])
  # "seq-mean-token-mean" treats the trajectory, over both its views, as one
  # sequence: (mean over its 6 action tokens + mean over exercise 6's 4) / 2.
  per_token = jnp.asarray(painted)
  loss = losses.aggregate_loss(per_token, jnp.asarray(batch.loss_mask),
                               "seq-mean-token-mean", seq_ids=jnp.asarray(batch.seq_ids))
  assert float(loss) == pytest.approx(((2 * 1 + 2 * 2 + 2 * 3) / 6 + (2 * 7 + 2 * 8) / 4) / 2)
  # Packing never puts two views of one trajectory in a row (they share a
  # seq id, so attention could cross), though both would fit.
  small = Trajectory(windowed_traj().segments[:3],
                     1.0, context_starts=[1])
  packed = collate([windowed_traj(), small], buckets=(16,), pack=True)
  for ids, positions in zip(packed.seq_ids, packed.positions):
    starts = ids[(ids >= 0) & (positions == 0)]  # each view starts at position 0
    assert len(starts) == len(set(starts)), "one view per trajectory per row"
  assert packed.tokens.shape[0] == 2


def test_sliding_window_validation_and_truncation():
  segs = windowed_traj().segments
  for starts, match in [([1, 1], "has 2 entries"), ([0, 1, 1], "between"),
                        ([1, 5, 5], "between"), ([1, 3, 1], "must not decrease"),
                        ([1, 1, 3, 5, 5], "has 5 entries"), ([1, 1, 3, 1], "must not decrease")]:
    with pytest.raises(ValueError, match=match):
      Trajectory(segs, 1.0, context_starts=starts).validate()
  with pytest.raises(ValueError, match="only when it ends on an observation"):
    Trajectory(segs[:-1], 1.0, context_starts=[1, 1, 3, 5]).validate()
  with pytest.raises(ValueError, match="sliding-window"):
    windowed_traj().to_steps()
  cut = truncate_to(windowed_traj(), 7)  # S S A0 A0 O0 A1 A1
  assert cut.context_starts == [1, 1] and cut.num_views == 1
