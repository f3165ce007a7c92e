"""Asynchronous rollouts: iteration i samples with the weights of iteration i - s.

With `RLConfig.max_staleness = s > 0` the trainer keeps the rollouts of the
next s iterations in flight on a worker thread while it updates. Before
iteration i's update it submits iteration i + s's rollouts with the weights
it holds then (those of iteration i), so iteration j always samples with
exactly the weights of iteration max(j - s, first): the staleness of every
trajectory is fixed by the schedule (s, less in the run's first s
iterations), never by thread timing, and under `RolloutConfig.lockstep` an
asynchronous run is as reproducible as a synchronous one.

Jobs run one at a time, in order, each on the weights it was submitted with
(`Sampler.prepare_params`: a compute-dtype copy on the sampler's devices,
made before the train step donates the parameters it was copied from); a
job installs its weights when it starts, so weights reach the sampler only
between rollout calls, each stamped with its version (`policy_version` on
every turn). `settle` waits for the jobs in flight: an evaluation or a
checkpoint then sees an idle engine, and the jobs' results wait, unchanged,
for their iterations. A crashed or killed run loses only the jobs in
flight: resuming from a checkpoint restarts the schedule there.

Python threads share the interpreter, but the trainer's jitted step and the
environments' waits release it: the overlap pays when rollouts wait on
environments (tools, sandboxes, simulators) or when the sampler has devices
of its own (`mesh.sampler_devices`). On a CPU whose cores the step already
fills, generation and training only take turns (benchmarks/async.py).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable, TypeVar

R = TypeVar("R")


class RolloutWorker:
  """Runs rollout jobs one at a time, in submission order, on one thread."""

  def __init__(self):
    self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
    self._jobs: dict[int, cf.Future] = {}

  def __contains__(self, iteration: int) -> bool:
    return iteration in self._jobs

  def submit(self, iteration: int, job: Callable[[], R]) -> None:
    """Queues `job`, iteration `iteration`'s rollouts."""
    if iteration in self._jobs:
      raise ValueError(f"iteration {iteration}'s rollouts are already in flight")
    self._jobs[iteration] = self._pool.submit(job)

  def take(self, iteration: int) -> R:
    """Waits for iteration `iteration`'s job and returns its result (an
    exception the job raised is raised here)."""
    return self._jobs.pop(iteration).result()

  def settle(self) -> None:
    """Waits until no job runs (their results stay for `take`)."""
    cf.wait(list(self._jobs.values()))

  def close(self) -> None:
    """Waits for the jobs in flight, then stops the thread; drops results."""
    self._pool.shutdown(wait=True)
    self._jobs.clear()
