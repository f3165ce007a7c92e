"""Rollout throughput: slow tools overlapped with decoding, and batched vs serial.

  python benchmarks/rollout.py [--episodes 32 --turns 4 --delay 0.05 --cohorts 8,16]

The same workload (32 episodes x 4 turns, 32-token actions, tiny Llama and
the bundled tokenizer) runs several ways in one process:
  instant  - the environment answers at once (batched engine);
  slow     - every env step sleeps `delay` seconds (batched engine): while
             one decode cohort's tools run, the others decode, so its
             throughput should stay close to the instant one (goal >= 0.8x);
  serial   - the reference text's loop, one episode after another, each
             action decoded alone (instant environment), for reference;
  window   - batched, instant, with a sliding-window context of 1 turn: from
             turn 2 on every turn re-prefills prompt + window instead of
             extending by one observation (the documented cost of that policy).
instant and slow run at each decode cohort size (`max_decode_batch`) in
`--cohorts`. Smaller cohorts overlap slow tools better: one 50 ms tool call
is hidden only if the other cohorts' decodes take as long (on this CPU a
16-row turn takes ~40 ms, an 8-row one ~20 ms). The first cohort is the
headline; `slow_vs_best_instant` is the stricter figure, the best slow run
against the best instant run over all cohorts.

Every configuration compiles all its shapes first (`RolloutEngine.warmup`);
their timed runs alternate (`--repeats` rounds: this machine's speed drifts
over minutes) and each reports its median. The last line is
`latency_overlap=X serial_vs_batched=Y` with X = slow / instant throughput at
the headline cohort and Y = serial / best batched (instant) throughput.
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
  p.add_argument("--cohorts", default="8,16",
                 help="decode batches (max_decode_batch) to run; the first is the headline")
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args()
  tok = T.load_tokenizer()
  model = models.Decoder(models.tiny_config("llama"), rngs=nnx.Rngs(0))
  tasks = [Task(f"t{i}", f"Task number {i}.") for i in range(args.episodes)]
  tokens = args.episodes * args.turns * args.action

  def engine(num_slots, delay, decode_batch, window=None):
    sampler = Sampler(model, num_slots=num_slots, cache_length=512,
                      max_decode_length=args.action, length_buckets=(32, 64))
    config = RolloutConfig(max_turns=args.turns, max_action_tokens=args.action,
                           env_workers=args.episodes, max_decode_batch=decode_batch,
                           context_window=window)
    engine = RolloutEngine(lambda: SleepyEnv(delay, args.turns), tok, T.CHATML,
                           sampler, config)
    engine.warmup()  # compile every shape before timing
    return engine

  def seconds(engine, episodes_per_run):
    t0 = time.perf_counter()
    for chunk in range(0, args.episodes, episodes_per_run):
      result = engine.run(tasks[chunk:chunk + episodes_per_run])
      assert all(t.num_turns == args.turns for t in result.trajectories)
    return time.perf_counter() - t0

  def measure(configs):
    """Median seconds per configuration, runs interleaved (this machine's
    speed drifts over minutes: a run of one config is never compared with a
    run of another made much later)."""
    engines = {name: engine(*c) for name, (c, _) in configs.items()}
    times = {name: [] for name in configs}
    for _ in range(args.repeats):
      for name, (_, per_run) in configs.items():
        times[name].append(seconds(engines[name], per_run))
    for e in engines.values():
      e.close()
    return {name: statistics.median(t) for name, t in times.items()}

  cohorts = [int(c) for c in args.cohorts.split(",")]
  configs = {}
  for c in cohorts:
    configs[f"instant/{c}"] = ((args.episodes, 0.0, c), args.episodes)
    configs[f"slow/{c}"] = ((args.episodes, args.delay, c), args.episodes)
  configs["serial"] = ((1, 0.0, None), 1)
  configs["window"] = ((args.episodes, 0.0, cohorts[0], 1), args.episodes)
  t = measure(configs)
  rate = {k: tokens / v for k, v in t.items()}
  print(f"{args.episodes} episodes x {args.turns} turns x {args.action}-token actions "
        f"(tiny Llama, CPU), median of {args.repeats} interleaved runs:")
  print(f"  decode cohort   instant env             {args.delay * 1e3:.0f} ms env steps"
        f"        slow/instant")
  for c in cohorts:
    i, s_ = f"instant/{c}", f"slow/{c}"
    print(f"  {c:13d}   {rate[i]:6.0f} tok/s ({t[i]:.2f} s)   {rate[s_]:6.0f} tok/s "
          f"({t[s_]:.2f} s)   {rate[s_] / rate[i]:.2f}")
  print(f"  serial episodes (seed's loop), instant env      {rate['serial']:6.0f} tok/s "
        f"({t['serial']:.2f} s)")
  print(f"  cohort {cohorts[0]}, instant env, 1-turn sliding window  {rate['window']:6.0f} "
        f"tok/s ({t['window']:.2f} s)")
  best_instant = max(rate[f"instant/{c}"] for c in cohorts)
  best_slow = max(rate[f"slow/{c}"] for c in cohorts)
  main_instant = rate[f"instant/{cohorts[0]}"]
  print(f"slow_vs_best_instant={best_slow / best_instant:.2f} (best of each over cohorts)")
  print(f"window_vs_append={rate['window'] / main_instant:.2f}")
  print(f"latency_overlap={rate[f'slow/{cohorts[0]}'] / main_instant:.2f} "
        f"serial_vs_batched={rate['serial'] / best_instant:.2f}")

if __name__ == "__main__":
  main()
