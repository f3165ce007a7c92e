"""Sequence packing in the RL step against one episode a row.

  python benchmarks/packing.py [--iterations 20] [--multiples 8]

Plain FrozenLake (`frozen_lake()` of experiments/configs/default.py: the
tiny model on 4x4 maps, 64 episodes of 1-8 turns per iteration, rows padded to the
bucket of the longest, 256-512 tokens). One SFT run, then from its
checkpoint each arm runs `experiments/train_agent.py`'s loop for the same
iterations and seed, all in this process: `rl.pack=False` (a row per
episode) and `rl.pack=True` with each `rl.pack_row_multiple` given. The
arms train on the same episodes up to the summation order of the step
(packed rows sum attention and the loss in another order, about 1e-6
apart, so the runs drift apart slowly). Reported per arm: the step's
seconds per iteration (after the first two, whose compiles are counted
apart in the total), rows and padded tokens per step, the whole step
time including compiles, and held-out greedy success after the last
iteration (64 unseen maps), so a speed-up is not bought with learning.
The median step time is what a step costs once its shape is compiled (a
few iterations compile a packed row count the step had not seen).

The last line is `pack_speedup=<unpacked step s / packed step s, per
iteration after the first two> multiple=<the first multiple given>`.
"""

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from configs import default  # pylint: disable=wrong-import-position
import from_sft  # pylint: disable=wrong-import-position


def arm_config(iterations: int, multiple: int):
  """The default config for `iterations` RL iterations; multiple 0: unpacked."""
  cfg = default.frozen_lake()
  cfg.rollout.temperature = cfg.loss.temperature = 1.0  # as the committed table was measured
  cfg.env.num_eval_tasks = 64
  cfg.eval_samples = 0  # greedy held-out success only
  cfg.iterations = iterations
  cfg.eval_every = cfg.checkpoint_every = max(iterations, 1)
  cfg.log.trajectories_every = 0
  cfg.rl.pack = multiple > 0
  cfg.rl.pack_row_multiple = max(multiple, 1)
  return cfg


def measure(workdir: pathlib.Path) -> dict[str, float]:
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if "time/step_s" in r]
  later = [r for r in rl if r["step"] >= 3]  # after the first two iterations
  mean = lambda key, rs=later: sum(r[key] for r in rs) / len(rs)
  summary = json.loads((workdir / "summary.json").read_text())
  return {"step_s": mean("time/step_s"), "iteration_s": mean("time/iteration_s"),
          "median_step_s": statistics.median(r["time/step_s"] for r in later),
          "total_step_s": sum(r["time/step_s"] for r in rl), "rows": mean("train/rows"),
          "length": mean("train/row_length"), "success": summary["rl_success"],
          "sft_success": summary["sft_success"]}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--multiples", default="8", help="pack_row_multiple of each packed arm")
  args = p.parse_args()
  arms = [0] + [int(m) for m in args.multiples.split(",")]
  results = from_sft.run_arms(arms, arm_config, args.iterations, measure)
  print(f"\n{args.iterations} iterations of 64 episodes; per iteration after the first two:")
  print("| rows | row multiple | train step (s) | its median (s) | s/iteration | "
        "rows x row length | step s, all iterations (compiles included) | "
        "held-out success (SFT -> RL) |")
  print("|---|---|---|---|---|---|---|---|")
  for m, r in results.items():
    print(f"| {'packed' if m else 'one episode each'} | {m or '-'} | {r['step_s']:.3f} | "
          f"{r['median_step_s']:.3f} | "
          f"{r['iteration_s']:.2f} | {r['rows']:.1f} x {r['length']:.0f} | "
          f"{r['total_step_s']:.1f} | {r['sft_success']:.3f} -> {r['success']:.3f} |")
  first = arms[1]
  print(f"pack_speedup={results[0]['step_s'] / results[first]['step_s']:.2f} multiple={first}")


if __name__ == "__main__":
  main()
