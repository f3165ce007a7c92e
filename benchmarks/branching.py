"""Branching's cost per RL iteration: forked prefixes vs re-prefilled ones.

  python benchmarks/branching.py [--iterations 10 --warmup 2 --seed 0]

The credit ablation's setup (`experiments/credit_ablation.py`, size "full"):
text FrozenLake with the shaped per-turn reward, the tiny model from its
SFT start. SFT runs once into a temporary directory; three RL runs of
`iterations` iterations then start from that checkpoint, one after another
in this process:
  grpo            the reference arm;
  branch_prefill  "branching" with `rl.fork_branches=False`: each of the
                  continuations (2 per turn after the first) is prefilled
                  with its whole recorded prefix;
  branch_fork     "branching" as configured by default: each continuation
                  forks its episode's cached prefix and computes only the
                  prefix's last token and its own new tokens.
Per run, the mean per iteration (the first `warmup`, which compile, left
out) of:
wall-clock (rollouts, credit assignment and the train step), environment
steps (continuations included), and the tokens the sampler computed: fed
(prompts and observations) and generated, for the rollouts and, apart, for
the continuations. The last line is `fork_vs_prefill_wall=X
fork_vs_prefill_branch_fed_tokens=Y prefill_vs_grpo_wall=Z fork_vs_grpo_wall=W`
(ratios of those means).
"""

import argparse
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import numpy as np  # pylint: disable=wrong-import-position

import credit_ablation  # pylint: disable=wrong-import-position
from agentrl_jax import metrics  # pylint: disable=wrong-import-position
import train_agent  # pylint: disable=wrong-import-position

ARMS = {"grpo": ("grpo", {}), "branch_prefill": ("branching", {"fork_branches": False}),
        "branch_fork": ("branching", {})}
COLUMNS = (("wall s", "time/iteration_s"), ("env steps", "rollout/env_steps"),
           ("fed", "rollout/sampler_fed_tokens"), ("generated", "generated"),
           ("branch fed", "rollout/branch_fed_tokens"),
           ("branch gen.", "rollout/branch_generated_tokens"),
           ("branch gen. s", "rollout/branch_generation_s"))


def config(scheme: str, seed: int, iterations: int, rl_overrides: dict):
  cfg = credit_ablation.config(scheme, seed, "full")
  cfg.iterations, cfg.eval_every, cfg.eval_samples = iterations, 10**6, 0
  cfg.log.trajectories_every = 0
  for key, value in rl_overrides.items():
    cfg.rl[key] = value
  return cfg


def per_iteration(rows: list[dict], warmup: int) -> dict[str, float]:
  """Means over the RL iterations after the first `warmup` (which compile)."""
  rows = [r for r in rows if r["step"] > warmup and "time/iteration_s" in r]
  for r in rows:
    r["generated"] = r["rollout/action_tokens_mean"] * r["rollout/episodes"]
  return {key: float(np.mean([r.get(key, 0.0) for r in rows])) for _, key in COLUMNS}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    sft = config("grpo", args.seed, 0, {})
    train_agent.run(sft, root / "sft")
    out = {}
    for arm, (scheme, overrides) in ARMS.items():
      workdir = root / arm
      workdir.mkdir()
      shutil.copytree(root / "sft" / "checkpoints", workdir / "checkpoints")
      train_agent.run(config(scheme, args.seed, args.iterations, overrides), workdir)
      out[arm] = per_iteration(metrics.read_metrics(workdir), args.warmup)
  print(f"\nper RL iteration, mean of iterations {args.warmup + 1}-{args.iterations} "
        f"(seed {args.seed}):")
  print(f"{'':16s}" + "".join(f"{name:>14s}" for name, _ in COLUMNS))
  for arm, m in out.items():
    print(f"{arm:16s}" + "".join(f"{m[key]:14.1f}" for _, key in COLUMNS))
  fork, prefill, grpo = out["branch_fork"], out["branch_prefill"], out["grpo"]
  wall = "time/iteration_s"
  print(f"fork_vs_prefill_wall={fork[wall] / prefill[wall]:.2f} "
        f"fork_vs_prefill_branch_fed_tokens="
        f"{fork['rollout/branch_fed_tokens'] / prefill['rollout/branch_fed_tokens']:.3f} "
        f"prefill_vs_grpo_wall={prefill[wall] / grpo[wall]:.2f} "
        f"fork_vs_grpo_wall={fork[wall] / grpo[wall]:.2f}")


if __name__ == "__main__":
  main()
