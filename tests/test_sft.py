"""SFT's loop: minibatches of the demos, and where it stops."""

import pytest

from agentrl_jax.train import sft
from agentrl_jax.trajectory import Role, Segment, Trajectory


def _demos(n):
  return [Trajectory([Segment(Role.SYSTEM, [1, 2]), Segment(Role.ASSISTANT, [5 + k, 9], [0.0] * 2)],
                     reward=1.0, terminated=True) for k in range(n)]


def _counting_step():
  """A step that counts its updates in the state and records its batches."""
  seen = []

  def step(state, batch):
    seen.append(batch)
    return state + 1, {"sft_loss": 0.0}
  return step, seen


def test_distill_runs_every_step_without_a_stop():
  step, seen = _counting_step()
  assert sft.distill(step, 0, _demos(6), steps=7, batch_size=4, buckets=(8,)) == 7
  assert len(seen) == 7


def test_distill_ends_after_the_update_its_stop_accepts():
  step, _ = _counting_step()
  calls = []

  def stop(i, state):
    calls.append((i, state))
    return state == 3
  assert sft.distill(step, 0, _demos(6), steps=10, batch_size=4, buckets=(8,), stop=stop) == 3
  assert calls == [(0, 1), (1, 2), (2, 3)]  # after each update, with its state


def test_stop_at_success_checks_every_nth_update_against_the_target():
  levels = iter([0.2, 0.5, 0.7])
  checked = []

  def success(state):
    checked.append(state)
    return next(levels)
  stop = sft.stop_at_success(success, target=0.5, every=3)
  # After update i the state is i + 1: checks after the 3rd and the 6th update.
  assert [stop(i, i + 1) for i in range(6)] == [False] * 5 + [True]
  assert checked == [3, 6]
  with pytest.raises(ValueError, match="every = 0 must be >= 1"):
    sft.stop_at_success(success, target=0.5, every=0)


def test_expert_demos_keep_the_successful_episodes_unless_told():
  trajs = _demos(3)
  for t, success in zip(trajs, (True, False, True)):
    t.metadata["success"] = success

  class Engine:
    def run(self, tasks, group_size, *, expert):
      assert (tasks, group_size, expert) == (["a", "b", "c"], 1, True)
      return type("Result", (), {"trajectories": trajs})
  assert sft.expert_demos(Engine(), ["a", "b", "c"]) == [trajs[0], trajs[2]]
  assert sft.expert_demos(Engine(), ["a", "b", "c"], keep_failed=True) == trajs
