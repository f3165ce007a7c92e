"""Asynchronous rollouts against synchronous RL where environments are slow.

  python benchmarks/async.py [--iterations 16] [--latency 0.2,0.3] [--staleness 1,2]

Plain FrozenLake (`frozen_lake()` of experiments/configs/default.py: the
tiny model on 4x4 maps, 64 episodes per iteration) with every environment step
sleeping a uniform 200-300 ms, a tool call's latency, on a thread per
episode: rollouts wait on environments about as long as the model
computes. One SFT run, then from
its checkpoint each arm runs `experiments/train_agent.py`'s loop for the
same iterations and seed, all in this process: synchronous
(`rl.max_staleness=0`) and each staleness given. Every arm trains with
`loss.is_correction=tis` (asynchronous RL needs it), so the arms differ only
in the schedule. Reported per arm: iterations per hour and action tokens
per second over the iterations after the first (its compiles excluded),
the time the trainer waited for rollouts, and held-out greedy success after
the last iteration (64 unseen maps), so a speed-up is not bought with
learning.

The last line is `async_vs_sync=<iterations/hour of the largest staleness
over the synchronous arm's> staleness_max=<that staleness>`.
"""

import argparse
import json
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from agentrl_jax import envs  # pylint: disable=wrong-import-position
from agentrl_jax.envs.frozen_lake import FrozenLakeEnv  # pylint: disable=wrong-import-position
from configs import default  # pylint: disable=wrong-import-position
import from_sft  # pylint: disable=wrong-import-position


class SlowFrozenLake(FrozenLakeEnv):
  """FrozenLake whose every step waits `latency` seconds (uniform) first."""

  latency = (0.2, 0.3)

  def step(self, action):
    time.sleep(random.uniform(*self.latency))
    return super().step(action)


def arm_config(iterations: int, staleness: int):
  cfg = default.frozen_lake()
  cfg.rollout.temperature = cfg.loss.temperature = 1.0  # as the committed table was measured
  cfg.env.name = "slow_frozen_lake"
  cfg.env.num_eval_tasks = 64
  cfg.rollout.env_workers = 64  # a thread per episode: its calls wait, they do not work
  cfg.eval_samples = 0  # greedy held-out success only
  cfg.iterations = iterations
  cfg.eval_every = cfg.checkpoint_every = max(iterations, 1)
  cfg.log.trajectories_every = 0
  cfg.loss.is_correction = "tis"
  cfg.rl.max_staleness = staleness
  return cfg


def measure(workdir: pathlib.Path) -> dict[str, float]:
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["step"] >= 2 and "time/iteration_s" in r]  # after the first
  seconds = sum(r["time/iteration_s"] for r in rl)
  tokens = sum(r["rollout/action_tokens_mean"] * r["rollout/episodes"] for r in rl)
  summary = json.loads((workdir / "summary.json").read_text())
  return {"iterations_per_hour": 3600 * len(rl) / seconds, "action_tokens_per_s": tokens / seconds,
          "rollout_wait_s": sum(r.get("time/rollout_wait_s", float("nan")) for r in rl) / len(rl),
          "iteration_s": seconds / len(rl),
          **{k: sum(r[key] for r in rl) / len(rl) for k, key in (
              ("generation_s", "rollout/generation_s"), ("env_wait_s", "rollout/env_wait_s"),
              ("step_s", "time/step_s"))},
          "staleness_max": max(r["rollout/staleness_max"] for r in rl),
          "success": summary["rl_success"], "sft_success": summary["sft_success"]}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--iterations", type=int, default=16)
  p.add_argument("--latency", default="0.2,0.3", help="seconds per step: low,high")
  p.add_argument("--staleness", default="1,2")
  args = p.parse_args()
  SlowFrozenLake.latency = tuple(float(x) for x in args.latency.split(","))
  envs.register("slow_frozen_lake", SlowFrozenLake)
  arms = [0] + [int(s) for s in args.staleness.split(",")]
  results = from_sft.run_arms(arms, arm_config, args.iterations, measure)
  print(f"\n{args.iterations} iterations, {SlowFrozenLake.latency[0]:.2f}-"
        f"{SlowFrozenLake.latency[1]:.2f} s per environment step; per iteration after "
        f"the first:")
  print("| max_staleness | iterations/hour | action tokens/s | s/iteration | of which the "
        "trainer waited for rollouts | rollout: decoding, waiting on envs | train step | "
        "held-out success (SFT -> RL) |")
  print("|---|---|---|---|---|---|---|---|")
  for s, r in results.items():
    print(f"| {s} | {r['iterations_per_hour']:.0f} | {r['action_tokens_per_s']:.0f} | "
          f"{r['iteration_s']:.2f} | {r['rollout_wait_s']:.2f} | {r['generation_s']:.2f}, "
          f"{r['env_wait_s']:.2f} | {r['step_s']:.2f} | "
          f"{r['sft_success']:.3f} -> {r['success']:.3f} |")
  top = max(arms)
  ratio = results[top]["iterations_per_hour"] / results[0]["iterations_per_hour"]
  print(f"async_vs_sync={ratio:.2f} staleness_max={results[top]['staleness_max']:.0f}")


if __name__ == "__main__":
  main()
