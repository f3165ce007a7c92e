"""EnvCaller: deadlines, abandoned threads, contract checks, latencies."""

import threading
import time

import pytest

from agentrl_jax import env_calls
from agentrl_jax.envs import StepResult, Task
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax import tokenizer as T


def test_a_hung_call_times_out_and_its_worker_is_replaced():
  release = threading.Event()
  caller = env_calls.EnvCaller(workers=1)
  try:
    hung = caller.submit(release.wait, 60, deadline_s=0.2)
    queued = caller.submit(lambda x: x + 1, 1, deadline_s=0.2)  # behind the hung one
    assert hung.result(timeout=10) == env_calls.Failure(
        env_calls.ENV_TIMEOUT, "no answer within the 0.2 s deadline")
    # The deadline counts from the start of a call, not its wait in the
    # queue: the replacement worker runs the queued call in full.
    assert queued.result(timeout=10) == 2
    assert caller.abandoned == 1
    latencies = caller.drain_latencies()
    assert len(latencies) == 2 and max(latencies) >= 0.2 and caller.drain_latencies() == []
  finally:
    t0 = time.perf_counter()
    caller.close()
    assert time.perf_counter() - t0 < 2  # never waits on the hung thread
    release.set()


def test_results_are_checked_and_errors_captured():
  caller = env_calls.EnvCaller(workers=2)
  good = StepResult("ok", 1, True, False, {})
  step = caller.submit(lambda: good, check=env_calls.checked_step).result()
  assert step == StepResult("ok", 1.0, True, False, {}) and type(step.reward) is float
  assert caller.submit(lambda: ("o", {}), check=env_calls.checked_reset).result() == ("o", {})
  for out, message in [
      (("o", {}, 1), "reset must return (observation, info), got a tuple of 3"),
      ((1, {}), "reset observation must be a str, got int"),
      (("o", []), "reset info must be a dict, got list")]:
    got = caller.submit(lambda out=out: out, check=env_calls.checked_reset).result()
    assert got == env_calls.Failure(env_calls.ENV_ERROR, f"ContractError: {message}")
  got = caller.submit(lambda: {}["key"]).result()
  assert got == env_calls.Failure(env_calls.ENV_ERROR, "KeyError: 'key'")
  caller.close()
  with pytest.raises(RuntimeError, match="closed"):
    caller.submit(print)


class _Slow:
  """Each step takes 0.5 s; declares a deadline of 0.2 s."""

  system_prompt, stop_strings, deadline_s = "", (), 0.2

  def reset(self, task):
    return "go", {}

  def step(self, action):
    time.sleep(0.5)
    return StepResult("late", 0.0, True, False, {})

  def close(self):
    pass

  @classmethod
  def expert(cls, task):
    return lambda observation: "x"


def test_an_environment_declares_its_own_deadline():
  tok = T.load_tokenizer()
  engine = RolloutEngine(_Slow, tok, T.CHATML, config=RolloutConfig(env_deadline_s=60))
  (t,) = engine.run([Task("t", "go")], expert=True).trajectories
  assert t.metadata["stop_reason"] == "env_timeout" and "0.2 s" in t.metadata["env_error"]
  engine.close()
