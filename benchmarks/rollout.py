"""Rollout throughput: slow tools overlapped with decoding, and batched vs serial.

  python benchmarks/rollout.py [--episodes 32 --turns 4 --delay 0.05 --cohort 16]

The same workload (32 episodes x 4 turns, 32-token actions, tiny Llama and
the bundled tokenizer) runs three ways in one process:
  instant  - the environment answers at once (batched engine);
  slow     - every env step sleeps `delay` seconds (batched engine): with
             concurrent env calls and decode cohorts, its throughput should
             stay close to the instant one (goal >= 0.8x);
  serial   - the reference text's loop, one episode after another, each
             action decoded alone (instant environment), for reference;
  window   - batched, instant, with a sliding-window context of 1 turn: from
             turn 2 on every turn re-prefills prompt + window instead of
             extending by one observation (the documented cost of that policy).
Every configuration compiles all its shapes first (`RolloutEngine.warmup`)
and reports the median of 3 timed runs. The last line is `latency_overlap=X serial_vs_batched=Y` with X = slow /
instant throughput and Y = serial / batched (instant) throughput.
"""

import argparse
import statistics
import time

from flax import nnx

from agentrl_jax import models
from agentrl_jax import tokenizer as T
from agentrl_jax.envs import StepResult, Task
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax.sampling import Sampler


class SleepyEnv:
  """Four turns of echo; each step sleeps `delay` (a slow tool)."""

  system_prompt = "Echo."
  stop_strings = ()

  def __init__(self, delay=0.0, turns=4):
    self.delay, self.turns = delay, turns

  def reset(self, task):
    self.n = 0
    return task.prompt, {}

  def step(self, action):
    time.sleep(self.delay)
    self.n += 1
    return StepResult(f"heard {len(action)} chars", 0.0, self.n >= self.turns, False, {})

  def close(self):
    pass


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--episodes", type=int, default=32)
  p.add_argument("--turns", type=int, default=4)
  p.add_argument("--action", type=int, default=32)
  p.add_argument("--delay", type=float, default=0.05)
  p.add_argument("--cohort", type=int, default=0, help="decode batch (0: half)")
  args = p.parse_args()
  tok = T.load_tokenizer()
  model = models.Decoder(models.tiny_config("llama"), rngs=nnx.Rngs(0))
  tasks = [Task(f"t{i}", f"Task number {i}.") for i in range(args.episodes)]
  tokens = args.episodes * args.turns * args.action

  def throughput(num_slots, delay, decode_batch, episodes_per_run, window=None):
    sampler = Sampler(model, num_slots=num_slots, cache_length=512,
                      max_decode_length=args.action, length_buckets=(32, 64))
    config = RolloutConfig(max_turns=args.turns, max_action_tokens=args.action,
                           env_workers=args.episodes, max_decode_batch=decode_batch,
                           context_window=window)
    engine = RolloutEngine(lambda: SleepyEnv(delay, args.turns), tok, T.CHATML,
                           sampler, config)
    engine.warmup()  # compile every shape before timing

    def once():
      t0 = time.perf_counter()
      for chunk in range(0, args.episodes, episodes_per_run):
        result = engine.run(tasks[chunk:chunk + episodes_per_run])
        assert all(t.num_turns == args.turns for t in result.trajectories)
      return time.perf_counter() - t0

    seconds = statistics.median(once() for _ in range(3))
    engine.close()
    return tokens / seconds, seconds

  cohort = args.cohort or args.episodes // 2
  instant, t_instant = throughput(args.episodes, 0.0, cohort, args.episodes)
  slow, t_slow = throughput(args.episodes, args.delay, cohort, args.episodes)
  serial, t_serial = throughput(1, 0.0, None, 1)
  window, t_window = throughput(args.episodes, 0.0, cohort, args.episodes, window=1)
  print(f"{args.episodes} episodes x {args.turns} turns x {args.action}-token actions "
        f"(tiny Llama, CPU), decode cohorts of {cohort}:")
  print(f"  batched, instant env      {instant:8.0f} tok/s  ({t_instant:.2f} s)")
  print(f"  batched, {args.delay * 1e3:.0f} ms env steps  {slow:8.0f} tok/s  ({t_slow:.2f} s)")
  print(f"  serial episodes (seed's loop), instant env  {serial:8.0f} tok/s  ({t_serial:.2f} s)")
  print(f"  batched, instant env, 1-turn sliding window  {window:8.0f} tok/s  "
        f"({t_window:.2f} s)")
  print(f"window_vs_append={window / instant:.2f}")
  print(f"latency_overlap={slow / instant:.2f} serial_vs_batched={serial / instant:.2f}")


if __name__ == "__main__":
  main()
