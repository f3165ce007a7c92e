"""DAPO in the RL loop: dynamic sampling with refill, overlong shaping, masking.

The loop runs against a scripted engine (each task's rollouts have fixed
rewards and lengths) and a step that records the batch it is given, so the
batch can be checked row by row.
"""

import pathlib
import sys
import types

import numpy as np
import pytest

from agentrl_jax.envs import Task
from agentrl_jax.train import rl
from agentrl_jax.train import step as step_lib
from agentrl_jax.trajectory import Role, Segment, Trajectory

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import train_agent  # pylint: disable=wrong-import-position

G = 2  # rollouts per task


def _traj(task, group, reward, actions=1, truncated=False):
  segs = [Segment(Role.SYSTEM, [1, 2, 3])]
  for k in range(actions):
    segs += [Segment(Role.ASSISTANT, [10 + k] * 3, [-1.0] * 3), Segment(Role.OBSERVATION, [7, 7])]
  return Trajectory(segs, reward=reward, turn_rewards=[0.0] * (actions - 1) + [reward],
                    terminated=not truncated, truncated=truncated,
                    metadata={"task_id": task.task_id, "group_id": group,
                              "stop_reason": "max_turns" if truncated else "terminated"})


class ScriptedEngine:
  """task.data["rewards"] are its G rollouts' returns; data["actions"] their
  turns; data["continuation"] the (return, turns) of every branch from it."""

  def __init__(self, max_context=64):
    self.max_context, self.runs, self.groups = max_context, [], 0
    self.config = types.SimpleNamespace(max_turns=16)
    self.sampler = types.SimpleNamespace(update_params=lambda params: None,
                                         drop_params=lambda: None)

  def run(self, tasks, group_size, **kwargs):
    del kwargs
    self.runs.append([t.task_id for t in tasks])
    trajs = []
    for task in tasks:
      for reward, actions, truncated in zip(task.data["rewards"], task.data["actions"],
                                            task.data.get("truncated", (False,) * group_size)):
        trajs.append(_traj(task, self.groups, reward, actions, truncated))
      self.groups += 1
    return types.SimpleNamespace(trajectories=trajs, metrics={"episodes": float(len(trajs))})

  def branch(self, points, n, **kwargs):
    del kwargs
    self.branch_metrics = dict.fromkeys(
        ("forked", "fed_tokens", "generated_tokens", "generation_s"), 0.0)
    return [[_traj(task, traj.metadata["group_id"], *task.data["continuation"])
             for _ in range(n)] for task, traj, _ in points]


class RecordingStep:
  mesh = None
  cfg = step_lib.LossConfig()

  def __init__(self):
    self.batches = []

  def __call__(self, state, batch, num_actions):
    self.batches.append((batch, num_actions))
    return state, {"skipped_updates": 0.0}


def _task(name, rewards, actions=(1, 1), truncated=(False, False)):
  return Task(name, name, {"rewards": rewards, "actions": actions, "truncated": truncated})


def _trainer(**cfg):
  engine, step = ScriptedEngine(), RecordingStep()
  trainer = rl.RLTrainer(engine, step, types.SimpleNamespace(params=None, model_params=None), rl.RLConfig(
      group_size=G, tasks_per_iteration=2, buckets=(16, 32, 128), **cfg))
  return trainer, engine, step


FLAT = [_task(f"flat{i}", (1.0, 1.0)) for i in range(3)]
# 8 and 13 tokens (bucket 16), then 8 and 23 (bucket 32).
GOOD = [_task(f"good{i}", (1.0, 0.0), actions=(1, 2 if i != 1 else 4)) for i in range(3)]


def _groups_of(batch):
  """The seq ids of each row (asserting one sequence per row)."""
  owners = [set(row[row >= 0].tolist()) for row in batch.seq_ids]
  assert all(len(o) <= 1 for o in owners)
  return [o.pop() if o else -1 for o in owners]


def test_refill_rolls_out_until_the_batch_holds_enough_informative_groups():
  trainer, engine, step = _trainer(filter_zero_variance=True, max_refill_tasks=4)
  spare = iter([GOOD[0], FLAT[2], GOOD[1], GOOD[2]])
  m = trainer.iteration(FLAT[:2], 1, refill=lambda n: [next(spare) for _ in range(n)])
  # Both first groups are flat; the first refill asks for the 2 missing
  # groups and gets 1 with signal, the second asks for 1 more.
  assert engine.runs == [["flat0", "flat1"], ["good0", "flat2"], ["good1"]]
  assert m["rollout/refill_tasks"] == 3 and m["rollout/informative_groups"] == 2
  assert m["rollout/dropped_groups"] == 2 and m["rollout/refill_episodes"] == 3 * G
  batch, num_actions = step.batches[0]
  owners = _groups_of(batch)
  real = [o for o in owners if o >= 0]
  # good0's and good1's were seq ids 0 and 1 of their rounds: 4 distinct ones.
  assert sorted(real) == [0, 1, 2, 3], "4 trajectories, seq ids renumbered from 0"
  # good0's rows (bucket 16) padded to good1's 32 columns; rows a multiple of tasks x G.
  assert batch.tokens.shape == (2 * G, 32)
  # The good groups' GRPO advantages: returns (1, 0) -> +-1 on every action token.
  on = batch.loss_mask > 0
  np.testing.assert_allclose(np.sort(np.unique(batch.advantages[on])), [-1.0, 1.0], atol=1e-5)
  assert m["train/batch_tokens"] == (1 + 2) * 3 + (1 + 4) * 3  # 3 tokens per action
  assert m["rollout/env_steps"] == 4 + (2 + 3) + 5  # the first round, then 2 refills
  assert num_actions >= 12


def test_refill_stops_at_its_cap_and_never_exceeds_the_group_count():
  trainer, engine, step = _trainer(filter_zero_variance=True, max_refill_tasks=1)
  m = trainer.iteration(FLAT[:2], 1, refill=lambda n: GOOD[:n])
  assert engine.runs[1:] == [["good0"]]
  assert m["rollout/refill_tasks"] == 1 and m["rollout/informative_groups"] == 1
  assert len([o for o in _groups_of(step.batches[0][0]) if o >= 0]) == G
  # One informative group in the first round: 1 task asked for, and taken
  # even from a refill that returns more.
  trainer, engine, step = _trainer(filter_zero_variance=True, max_refill_tasks=4)
  m = trainer.iteration([FLAT[0], GOOD[0]], 1, refill=lambda n: GOOD[1:])
  assert engine.runs[1:] == [["good1"]] and m["rollout/informative_groups"] == 2
  # Without refill the loop only drops.
  trainer, engine, step = _trainer(filter_zero_variance=True)
  m = trainer.iteration([FLAT[0], GOOD[0]], 1, refill=lambda n: GOOD[1:1 + n])
  assert len(engine.runs) == 1 and "rollout/refill_tasks" not in m


def test_dynamic_sampling_config_errors():
  with pytest.raises(ValueError, match="turn filtering on"):
    rl.RLConfig(max_refill_tasks=2)
  with pytest.raises(ValueError, match="partial rollouts"):
    rl.RLConfig(max_refill_tasks=2, filter_zero_variance=True, token_budget=100)
  with pytest.raises(ValueError, match="below the context budget"):
    _trainer(overlong_buffer=64)
  for frac in (0.0, 1.5):
    with pytest.raises(ValueError, match=r"top_variance_frac = .* must be in \(0, 1\]"):
      rl.RLConfig(top_variance_frac=frac)
  with pytest.raises(ValueError, match="use one of the two"):
    rl.RLConfig(max_refill_tasks=2, filter_zero_variance=True, top_variance_frac=0.5)


@pytest.mark.parametrize("frac, kept_tasks", [
    (0.25, ["spread_a"]), (0.5, ["spread_a", "spread_b"]),
    (0.75, ["spread_a", "spread_b", "half"]), (1.0, ["flat", "spread_a", "half", "spread_b"])])
def test_top_variance_frac_trains_the_groups_whose_rewards_spread_most(frac, kept_tasks):
  """RAGEN's rollout filter. Rewards of 3 episodes a task, and their
  standard deviations: flat (1, 1, 1) 0; spread_a (0, 1, 0) and spread_b
  (1, 0, 0) 0.471 each (a tie: the group seen first goes first); half
  (0, 0.5, 0) 0.236. ceil(frac x 4) groups stay."""
  three = dict(actions=(1, 1, 1), truncated=(False,) * 3)
  tasks = [_task("flat", (1.0, 1.0, 1.0), **three), _task("spread_a", (0.0, 1.0, 0.0), **three),
           _task("half", (0.0, 0.5, 0.0), **three), _task("spread_b", (1.0, 0.0, 0.0), **three)]
  engine, step = ScriptedEngine(max_context=16), RecordingStep()
  trainer = rl.RLTrainer(engine, step, types.SimpleNamespace(params=None, model_params=None),
                         rl.RLConfig(group_size=3, tasks_per_iteration=4, buckets=(16,),
                                     top_variance_frac=frac))
  m = trainer.iteration(tasks, 1)
  batch = step.batches[0][0]
  names = [t.task_id for t in tasks]
  owners = [o for o in _groups_of(batch) if o >= 0]
  assert sorted(owners) == sorted(3 * names.index(n) + i for n in kept_tasks for i in range(3))
  assert batch.tokens.shape[0] == 12  # padded to tasks x group_size rows
  if frac < 1:
    assert m["rollout/variance_kept_frac"] == len(kept_tasks) / 4
  else:
    assert "rollout/variance_kept_frac" not in m


def test_overlong_shaping_by_hand():
  # Budget 64, buffer 16: the penalty grows from 0 at 48 tokens to 1 at 64.
  # A trajectory holds 3 + 5 x actions tokens.
  task = Task("t", "t", {})
  trajs = [_traj(task, 0, 1.0, actions=a) for a in (9, 10, 12, 13)]  # 48, 53, 63, 68 tokens
  shaped, penalties = rl.overlong_shaped(trajs, 64, 16, 0.5)
  np.testing.assert_allclose(penalties, [0.0, 0.5 * 5 / 16, 0.5 * 15 / 16, 0.5])
  for t, s, p in zip(trajs, shaped, penalties):
    assert s.reward == pytest.approx(1.0 - p)
    assert s.turn_rewards[:-1] == t.turn_rewards[:-1]
    assert s.turn_rewards[-1] == pytest.approx(1.0 - p)
  assert shaped[0] is trajs[0] and trajs[1].reward == 1.0, "the recording is not changed"


def test_overlong_penalty_reaches_the_advantages():
  trainer, _, step = _trainer(overlong_buffer=16, overlong_penalty=1.0)
  long_and_short = _task("ls", (1.0, 1.0), actions=(13, 1))  # 68 and 8 tokens
  m = trainer.iteration([long_and_short, FLAT[0]], 1)
  batch = step.batches[0][0]
  # Returns 0 (shaped from 1) and 1: GRPO gives -1 and +1; the flat group 0.
  adv = {o: batch.advantages[r][batch.loss_mask[r] > 0] for r, o in
         enumerate(_groups_of(batch)) if o >= 0}
  np.testing.assert_allclose(adv[0], -1.0, atol=1e-5)
  np.testing.assert_allclose(adv[1], 1.0, atol=1e-5)
  np.testing.assert_allclose(adv[2], 0.0)
  assert m["rollout/overlong_frac"] == 0.25 and m["rollout/overlong_penalty_mean"] == 0.25


def _per_turn(batch):
  """{(seq id, turn): the advantage on that turn's tokens}."""
  on = batch.loss_mask > 0
  return {(int(i), int(k)): float(a) for i, k, a in zip(
      batch.seq_ids[on], batch.turn_index[on], batch.advantages[on])}


def test_branch_continuations_are_shaped_like_the_episodes():
  # Budget 16, buffer 8: 3 + 5 x turns tokens, so 2 turns (13 tokens) lose
  # 5/8 and 1 turn (8) nothing. A: 2 turns, rewards [0, 1] -> [0, 3/8]; B: 1
  # turn, 0. Both branches from A's turn 1 replay A: 2 turns, return 1,
  # shaped 3/8 like A. V(s_0) = mean(3/8, 0) = 3/16 for both, V(s_1) =
  # mean(3/8, 3/8, 3/8) (unshaped branches: mean(3/8, 1, 1) = 19/24).
  # Branching (TD, gamma 1): A_0 = 0 + V(s_1) - V(s_0) = 3/16, A_1 = 3/8 -
  # V(s_1) = 0; B_0 = 0 - 3/16.
  engine, step = ScriptedEngine(max_context=16), RecordingStep()
  trainer = rl.RLTrainer(engine, step, types.SimpleNamespace(params=None, model_params=None), rl.RLConfig(
      group_size=G, tasks_per_iteration=1, buckets=(16,), credit="branching",
      branch_size=2, overlong_buffer=8, overlong_penalty=1.0))
  task = Task("b", "b", {"rewards": (1.0, 0.0), "actions": (2, 1),
                         "continuation": (1.0, 2)})
  m = trainer.iteration([task], 1)
  assert m["rollout/branch_episodes"] == 2
  got = _per_turn(step.batches[0][0])
  assert got == pytest.approx({(0, 0): 3 / 16, (0, 1): 0.0, (1, 0): -3 / 16}, abs=1e-6)


def test_dynamic_sampling_filters_on_the_outcome_not_the_shaped_reward():
  # allgood: both right, one overlong (68 tokens, shaped to 0): the shaped
  # returns differ (GRPO +-1), the outcomes do not, so DAPO drops it.
  trainer, _, step = _trainer(filter_zero_variance=True, overlong_buffer=16)
  allgood = _task("allgood", (1.0, 1.0), actions=(13, 1))
  m = trainer.iteration([allgood, GOOD[0]], 1)
  assert m["rollout/dropped_groups"] == 1 and m["rollout/kept_frac"] == 0.5
  batch = step.batches[0][0]
  assert {o for o in _groups_of(batch) if o >= 0} == {2, 3}, "GOOD[0]'s rollouts"
  assert sorted(set(_per_turn(batch).values())) == pytest.approx([-1.0, 1.0], abs=1e-5)


@pytest.mark.parametrize("credit, kept", [("grpo", 0.0), ("turn_returns", 0.5)])
def test_dynamic_sampling_of_singleton_groups(credit, kept):
  # group_size 1: a group-relative advantage is always 0 (its baseline is
  # itself), so grpo drops every group; a scheme without a group baseline
  # keeps those with signal: return 1 (overlong, shaped to 0: kept on its
  # outcome), not return 0.
  engine, step = ScriptedEngine(), RecordingStep()
  trainer = rl.RLTrainer(engine, step, types.SimpleNamespace(params=None, model_params=None), rl.RLConfig(
      group_size=1, tasks_per_iteration=2, buckets=(128,), credit=credit,
      filter_zero_variance=True, overlong_buffer=16))
  tasks = [_task("one", (1.0,), actions=(13,), truncated=(False,)),
           _task("zero", (0.0,), actions=(1,), truncated=(False,))]
  m = trainer.iteration(tasks, 1)
  assert m["rollout/kept_frac"] == kept
  if kept:
    assert _groups_of(step.batches[0][0])[0] == 0, "the return-1 episode"
  else:
    assert m["train/skipped_batch"] == 1.0 and not step.batches


def test_truncated_episodes_keep_their_baseline_but_get_no_loss():
  trainer, _, step = _trainer(mask_truncated=True)
  task = _task("t", (1.0, 0.0), truncated=(False, True))
  trainer.iteration([task, FLAT[0]], 1)
  batch = step.batches[0][0]
  owners = _groups_of(batch)
  row = {o: r for r, o in enumerate(owners) if o >= 0}
  # The truncated rollout (return 0) still makes the other's advantage +1.
  on = batch.loss_mask[row[0]] > 0
  np.testing.assert_allclose(batch.advantages[row[0]][on], 1.0, atol=1e-5)
  assert batch.loss_mask[row[1]].sum() == 0 and (batch.advantages[row[1]] != 0).any()
  assert batch.loss_mask[row[2]].sum() > 0


def test_train_agent_refills_from_the_pool_without_repeats():
  pool = list(range(10))
  rng = np.random.default_rng([0, 3])
  chosen = rng.choice(len(pool), 3, replace=False)
  draw = train_agent._refill(pool, chosen, rng)  # pylint: disable=protected-access
  got = draw(4) + draw(2) + draw(5)
  assert len(got) == 7 and sorted(got + chosen.tolist()) == pool
  # The iteration's own tasks are drawn before, and as without refill.
  np.testing.assert_array_equal(
      chosen, np.random.default_rng([0, 3]).choice(len(pool), 3, replace=False))
