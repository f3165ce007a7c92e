"""Calling environments safely: deadlines, contract checks, errors, latency.

The rollout engine calls `reset`, `step` and `close` only through an
`EnvCaller`, so one bad environment ends its own episode and nothing else:

- Deadline: a call still running `deadline_s` after it started completes
  its future with `Failure(ENV_TIMEOUT)`. Python cannot kill a thread, so
  the thread is abandoned (a daemon, never joined; `abandoned` counts them)
  and a fresh worker takes its place; whatever the call returns later is
  dropped. `close()` never waits on an abandoned thread.
- Contract: `reset` returns `(str, dict)`; `step` returns a `StepResult`
  with an observation (a str, or a list of strs: one per tool call) that
  encodes as UTF-8, a finite real reward, bool
  flags and a dict info (with numeric `reward_parts`, if any). Anything
  else, and any exception, completes the future with `Failure(ENV_ERROR)`
  and the exception's text. A future never raises.
- Latency: the seconds of every finished or timed-out call, for per-call
  percentiles (`drain_latencies`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import numbers
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from agentrl_jax.envs.base import StepResult

ENV_ERROR = "env_error"
ENV_TIMEOUT = "env_timeout"
_MAX_MESSAGE = 2000  # characters of an error text kept in the trajectory


@dataclasses.dataclass(frozen=True)
class Failure:
  """What a failed call returns instead of a result."""
  reason: str  # ENV_ERROR | ENV_TIMEOUT
  message: str


class ContractError(TypeError):
  """An environment returned something the contract does not allow."""


def _observation(value: Any, what: str) -> str | tuple[str, ...]:
  if isinstance(value, (list, tuple)) and what == "step":  # one text per tool call
    return tuple(_observation(v, "step result") for v in value)
  if not isinstance(value, str):
    raise ContractError(f"{what} observation must be a str"
                        f"{' or a list of strs' if what == 'step' else ''}, "
                        f"got {type(value).__name__}")
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:  # a lone surrogate: no token ids exist for it
    raise ContractError(f"{what} observation is not valid Unicode: {e}") from None
  return value


def _info(value: Any, what: str) -> dict:
  if not isinstance(value, dict):
    raise ContractError(f"{what} info must be a dict, got {type(value).__name__}")
  parts = value.get("reward_parts", {})
  if not (isinstance(parts, dict) and all(
      isinstance(v, numbers.Real) and math.isfinite(v) for v in parts.values())):
    raise ContractError(f"{what} info['reward_parts'] must map names to finite "
                        f"numbers, got {parts!r:.200}")
  return value


def checked_reset(out: Any) -> tuple[str, dict]:
  """`reset`'s `(observation, info)`, or ContractError."""
  if not (isinstance(out, tuple) and len(out) == 2):
    raise ContractError(f"reset must return (observation, info), got {_describe(out)}")
  return _observation(out[0], "reset"), _info(out[1], "reset")


def checked_step(out: Any) -> StepResult:
  """`step`'s StepResult with plain float and bool fields, or ContractError."""
  if not isinstance(out, StepResult):
    raise ContractError(f"step must return a StepResult, got {_describe(out)}")
  reward = out.reward
  if not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
    raise ContractError(f"step reward must be a finite number, got {reward!r:.100}")
  for name in ("terminated", "truncated"):
    if not isinstance(getattr(out, name), (bool, np.bool_)):
      raise ContractError(f"step {name} must be a bool, got "
                          f"{type(getattr(out, name)).__name__}")
  return StepResult(_observation(out.observation, "step"), float(reward),
                    bool(out.terminated), bool(out.truncated), _info(out.info, "step"))


def _describe(out: Any) -> str:
  if isinstance(out, tuple):
    return f"a tuple of {len(out)}"
  return type(out).__name__


@dataclasses.dataclass(eq=False)
class _Job:
  future: cf.Future
  fn: Callable
  args: tuple
  check: Callable | None
  deadline_s: float | None
  due: float = math.inf  # monotonic time the call must be back by, once started


class EnvCaller:
  """A pool of daemon worker threads that run environment calls under
  deadlines; `submit` returns a future whose result is the checked value
  or a `Failure`."""

  def __init__(self, workers: int):
    if workers < 1:
      raise ValueError(f"env_workers must be >= 1, got {workers}")
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Condition()
    self._running: set[_Job] = set()  # started calls with a deadline
    self._workers = 0  # live, not abandoned
    self._closed = False
    self._latencies: list[float] = []
    self.abandoned = 0
    with self._lock:
      for _ in range(workers):
        self._spawn()
    threading.Thread(target=self._watch, daemon=True, name="env-watchdog").start()

  def submit(self, fn: Callable, *args, check: Callable | None = None,
             deadline_s: float | None = None) -> cf.Future:
    """Runs `check(fn(*args))` on a worker; `deadline_s` counts from the start
    of the call (not its wait in the queue), None for no deadline."""
    if self._closed:
      raise RuntimeError("this EnvCaller is closed")
    future = cf.Future()
    self._jobs.put(_Job(future, fn, args, check, deadline_s))
    return future

  def drain_latencies(self) -> list[float]:
    """Seconds of the calls finished (or timed out) since the last drain."""
    with self._lock:
      out, self._latencies = self._latencies, []
    return out

  def close(self, timeout_s: float = 10.0) -> None:
    """Lets the workers finish the calls already queued, waiting at most
    `timeout_s` for them; abandoned (hung) threads are never waited on."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      self._lock.notify_all()
      workers = self._workers
    done = threading.Semaphore(0)
    for _ in range(workers):
      self._jobs.put(done)
    end = time.monotonic() + timeout_s
    for _ in range(workers):
      if not done.acquire(timeout=max(end - time.monotonic(), 0)):
        break

  def _spawn(self) -> None:
    self._workers += 1
    threading.Thread(target=self._work, daemon=True, name="env-worker").start()

  def _work(self) -> None:
    while True:
      job = self._jobs.get()
      if isinstance(job, threading.Semaphore):  # close(): this worker is done
        job.release()
        return
      if not job.future.set_running_or_notify_cancel():
        continue
      start = time.monotonic()
      if job.deadline_s is not None:
        with self._lock:
          job.due = start + job.deadline_s
          self._running.add(job)
          self._lock.notify_all()
      try:
        out = job.fn(*job.args)
        out = job.check(out) if job.check is not None else out
      except BaseException as e:  # pylint: disable=broad-except
        # SystemExit from an environment ends its episode, not this worker.
        out = Failure(ENV_ERROR, f"{type(e).__name__}: {e}"[:_MAX_MESSAGE])
      with self._lock:
        if job.future.done():  # it timed out: a replacement took this thread's place
          return
        self._running.discard(job)
        self._latencies.append(time.monotonic() - start)
        job.future.set_result(out)

  def _watch(self) -> None:
    """Completes overdue calls with ENV_TIMEOUT and replaces their workers."""
    with self._lock:
      while not self._closed:
        now = time.monotonic()
        for job in [j for j in self._running if j.due <= now]:
          self._running.discard(job)
          self.abandoned += 1
          self._workers -= 1
          self._latencies.append(now - (job.due - job.deadline_s))
          job.future.set_result(Failure(
              ENV_TIMEOUT, f"no answer within the {job.deadline_s:g} s deadline"))
          self._spawn()
        due = min((j.due for j in self._running), default=None)
        self._lock.wait(None if due is None else max(due - now, 0.0))
