"""Asynchronous RL (`rl.max_staleness`): the schedule, its bound, evaluation.

The threaded pipeline is checked against the schedule's definition run on
one thread: iteration i samples with the weights iteration max(i - s, 1)
held, and trains with the weights of iteration i. Everything runs in
lockstep and is seeded, so both must agree bit for bit.
"""

import jax
import numpy as np
import pytest

from agentrl_jax.models import compute_params
from agentrl_jax.train import pipeline, rl
from test_rl_learning import LookupEnv, _trainer

# The entropy bonus moves the weights every step, also where the random
# policy's rewards give no advantage.
TIS = {"is_correction": "tis", "entropy_coef": 0.05}
TASKS = LookupEnv.tasks("train", 12, 0)


def _tasks(i):
  return TASKS[2 * (i - 1) % len(TASKS):][:2]


def _untimed(m):
  return {k: v for k, v in m.items() if not k.startswith("time/") and not k.endswith("_s")}


def _run_async(s, n, between=None):
  trainer = _trainer({}, {"max_staleness": s}, TIS)
  out = []
  for i in range(1, n + 1):
    out.append(trainer.iteration(_tasks(i), i, record=True,
                                 upcoming=lambda j: _tasks(j) if j <= n else None))
    out[-1]["versions"] = sorted({v for t in trainer.recorded.trajectories
                                  for v in t.metadata["policy_versions"]})
    out[-1]["sampler_logprobs"] = trainer.recorded.batch.old_logprobs
    if between is not None:
      between(trainer, i)
  trainer.close()
  return trainer, out


def _run_by_definition(s, n):
  """The schedule on one thread: a synchronous trainer whose rollouts of
  iteration i are given the weights of iteration max(i - s, 1)."""
  trainer, weights, out = _trainer({}, {}, TIS), {}, []
  for i in range(1, n + 1):
    weights[i] = trainer.engine.sampler.prepare_params(trainer.state.params)
    version = max(i - s, 1)
    rolled = trainer._rollout(_tasks(i), i, version, weights[version])
    out.append(trainer._learn(rolled, _tasks(i), i, None, True))
    out[-1]["sampler_logprobs"] = trainer.recorded.batch.old_logprobs
  return trainer, out


@pytest.mark.parametrize("s", [0, 1, 2])  # 0: the synchronous loop
def test_async_iterations_equal_the_schedule_run_on_one_thread(s):
  n = 4
  (a, got), (b, want) = _run_async(s, n), _run_by_definition(s, n)
  for i, (g, w) in enumerate(zip(got, want), start=1):
    # Every episode of iteration i was sampled by version max(i - s, 1) alone:
    # the bound holds with equality once the pipeline is full.
    assert g.pop("versions") == [max(i - s, 1)]
    assert g["rollout/staleness_max"] == g["rollout/staleness_mean"] == min(i - 1, s)
    np.testing.assert_array_equal(g.pop("sampler_logprobs"), w.pop("sampler_logprobs"))
    assert _untimed(g) == _untimed(w), i
    assert ("time/rollout_wait_s" in g) == (s > 0)
  jax.tree.map(np.testing.assert_array_equal, a.state.params, b.state.params)


def test_async_differs_from_sync():
  """The check above can fail: the weights a rollout samples with matter."""
  _, got = _run_async(1, 3)
  sync = _trainer({}, {}, TIS)
  for i, g in enumerate(got, start=1):
    sync.iteration(_tasks(i), i, record=True)
    same = np.array_equal(g["sampler_logprobs"], sync.recorded.batch.old_logprobs)
    assert same == (i == 1), i  # the first samples with the same weights, later ones not


def test_an_evaluation_between_iterations_leaves_the_run_unchanged():
  evaluations = []

  def evaluate(trainer, i):
    if i == 2:
      trainer.settle()  # iteration 3's rollouts, in flight, finish first
      live = compute_params(trainer.state.params, trainer.engine.sampler.cfg.dtype)
      jax.tree.map(np.testing.assert_array_equal, trainer.engine.sampler.params, live)
      evaluations.append(rl.evaluate(trainer.engine, LookupEnv.tasks("test", 4, 0),
                                     policy_version=i))

  (_, with_eval), (_, without) = _run_async(1, 4, between=evaluate), _run_async(1, 4)
  assert len(evaluations) == 1 and 0 <= evaluations[0]["success"] <= 1
  for a, b in zip(with_eval, without, strict=True):
    np.testing.assert_array_equal(a.pop("sampler_logprobs"), b.pop("sampler_logprobs"))
    assert _untimed(a) == _untimed(b)


def test_max_staleness_refuses_what_it_cannot_bound():
  with pytest.raises(ValueError, match="partial rollouts"):
    rl.RLConfig(max_staleness=1, token_budget=64)
  with pytest.raises(ValueError, match="dynamic sampling"):
    rl.RLConfig(max_staleness=1, filter_zero_variance=True, max_refill_tasks=2)
  with pytest.raises(ValueError, match="max_staleness = -1 must be >= 0"):
    rl.RLConfig(max_staleness=-1)
  with pytest.raises(ValueError, match="is_correction='tis'"):
    _trainer({}, {"max_staleness": 1})
  with pytest.raises(ValueError, match="continuations"):
    _trainer({}, {"max_staleness": 1, "credit": "branching"}, TIS)
  with pytest.raises(ValueError, match="pass `upcoming`"):
    _trainer({}, {"max_staleness": 1}, TIS).iteration(_tasks(1), 1)


def test_rollouts_started_ahead_must_be_on_the_tasks_given_later():
  trainer = _trainer({}, {"max_staleness": 1}, TIS)
  trainer.iteration(_tasks(1), 1, upcoming=_tasks)  # starts iteration 2 on _tasks(2)
  with pytest.raises(ValueError, match="other tasks than it was given"):
    trainer.iteration(_tasks(3), 2, upcoming=_tasks)
  trainer.close()


def test_worker_runs_jobs_in_order_and_raises_their_errors():
  worker, order = pipeline.RolloutWorker(), []
  for i in range(3):
    worker.submit(i, lambda i=i: order.append(i) or i * 10)
  with pytest.raises(ValueError, match="already in flight"):
    worker.submit(1, lambda: None)
  worker.settle()
  assert order == [0, 1, 2] and 2 in worker
  assert [worker.take(i) for i in (2, 0, 1)] == [20, 0, 10]
  worker.submit(3, lambda: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    worker.take(3)
  worker.close()
