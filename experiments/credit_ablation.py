"""Credit-assignment ablation: one RL run per scheme from the same SFT start.

Drives `notebooks/credit_assignment.ipynb`; also runs as a script:

  python experiments/credit_ablation.py --size=full --root=runs/credit_ablation

For each seed, SFT runs once (`<root>/sft/seed<k>`, a `train_agent` run with
0 RL iterations); every scheme's run (`<root>/<scheme>/seed<k>`) starts from
a copy of that workdir, so all schemes resume from the identical SFT
checkpoint and see the same tasks in the same order. The model always has a
value head (only "gae" trains it), so the checkpoint fits every scheme.
Finished runs are reused, so an interrupted ablation picks up where it was.

The environment is text FrozenLake with the shaped per-turn reward (0.1 per
cell closer to the goal), gamma 0.9 (`configs/frozen_lake_turn_credit.py`).
"""

import argparse
import json
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from flax import nnx  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from agentrl_jax import checkpointing, metrics, train, viewer  # pylint: disable=wrong-import-position
from agentrl_jax.train import credit, presets, rl  # pylint: disable=wrong-import-position
from agentrl_jax.trajectory import collate, turn_arrays  # pylint: disable=wrong-import-position
from configs import frozen_lake_turn_credit  # pylint: disable=wrong-import-position
import train_agent  # pylint: disable=wrong-import-position

SCHEMES = ("grpo", "drgrpo", "dapo", "rloo", "turn_returns", "gae", "branching", "gigpo")

# Overrides of configs/frozen_lake_turn_credit.py per size.
SIZES = {
    # A few minutes on 2 CPU cores: the test suite executes the notebook so.
    "tiny": dict(seeds=(0,), overrides={
        "iterations": 2, "eval_every": 1, "checkpoint_every": 100,
        "sft.steps": 4, "sft.num_demos": 8, "sft.batch_size": 4,
        "env.num_train_tasks": 40, "env.num_eval_tasks": 4,
        "rl.tasks_per_iteration": 2, "rl.group_size": 2, "sampler.num_slots": 8}),
    # The real comparison (runtime on this CPU: see the README).
    # The RL batch and learning rate are pinned: the committed notebook was
    # run with these, before the default config moved to 8 maps at 5e-5.
    "full": dict(seeds=tuple(range(8)), overrides={
        "iterations": 30, "eval_every": 5, "checkpoint_every": 100,
        "env.num_eval_tasks": 64, "rl.tasks_per_iteration": 4,
        "rl_optim.learning_rate": 1e-4, "rl_optim.total_steps": 200}),
}


def config(scheme: str, seed: int, size: str):
  """The arm `scheme`: a credit scheme, or a named algorithm (`presets`)."""
  if scheme in presets.PRESETS:  # the arm is the named algorithm, not just its estimator
    cfg = frozen_lake_turn_credit.get_config(presets.PRESETS[scheme].credit)
    cfg.algorithm = scheme
  else:
    cfg = frozen_lake_turn_credit.get_config(scheme)
  cfg.seed = seed
  cfg.model.value_head = True
  # Whole-cache decode, as when the committed notebook ran (see default.py).
  cfg.sampler.attention_windows = (cfg.sampler.cache_length,)
  for key, value in SIZES[size]["overrides"].items():
    node = cfg
    *path, leaf = key.split(".")
    for part in path:
      node = node[part]
    node[leaf] = value
  return cfg


def _done(workdir: pathlib.Path) -> bool:
  return (workdir / "summary.json").exists()


def run(size: str, root, schemes=SCHEMES) -> dict:
  """Runs (or reuses) every (scheme, seed); returns their metric rows.

  The runs share a persistent compilation cache (`<root>/jax_cache`): every
  run builds the same programs, so only the first to need one compiles it
  and the others' wall-clock holds little compile time.
  """
  root = pathlib.Path(root)
  jax.config.update("jax_compilation_cache_dir", str(root / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  results = {}
  for seed in SIZES[size]["seeds"]:
    sft_dir = root / "sft" / f"seed{seed}"
    if not _done(sft_dir):
      cfg = config(schemes[0], seed, size)
      cfg.iterations = 0
      train_agent.run(cfg, sft_dir)
    for scheme in schemes:
      workdir = root / scheme / f"seed{seed}"
      if not _done(workdir):
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        shutil.copytree(sft_dir / "checkpoints", workdir / "checkpoints")
        shutil.copy(sft_dir / "metrics.jsonl", workdir / "metrics.jsonl")
        train_agent.run(config(scheme, seed, size), workdir)
      results[scheme, seed] = metrics.read_metrics(workdir)
  return results


def bootstrap_mean(values, *, level: float = 0.95, resamples: int = 10_000,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(mean, low, high): the mean over axis 0 (seeds) and its percentile
  bootstrap interval, resampling the seeds with replacement. values [n, ...]."""
  values = np.asarray(values, np.float64)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(values), (resamples, len(values)))
  means = values[idx].mean(axis=1)
  tail = (1 - level) / 2 * 100
  low, high = np.percentile(means, [tail, 100 - tail], axis=0)
  return values.mean(axis=0), low, high


def curves(results: dict, key: str, x: str = "env_steps") -> dict:
  """Per scheme: (x [n], mean [n], low [n], high [n]) over seeds of `key` at
  RL steps: the mean and its 95% bootstrap interval over seeds.

  x: "env_steps" (cumulative environment steps sampled, branch
  continuations included) or "wall_s" (cumulative seconds of rollouts,
  credit assignment and train steps, evaluation excluded). Step 0 is the
  shared SFT start.
  """
  out = {}
  for scheme in dict.fromkeys(s for s, _ in results):
    xs, ys = [], []
    for (s, _), rows in results.items():
      if s != scheme:
        continue
      rl_rows = [r for r in rows if r["step"] >= 0]
      counter = "rollout/env_steps" if x == "env_steps" else "time/iteration_s"
      total, pts = 0.0, {}
      for r in rl_rows:
        total += r.get(counter, 0.0)
        if key in r:
          pts[r["step"]] = (total, r[key])
      xs.append([p[0] for _, p in sorted(pts.items())])
      ys.append([p[1] for _, p in sorted(pts.items())])
    n = min(len(v) for v in ys)
    xs, ys = np.asarray([v[:n] for v in xs]), np.asarray([v[:n] for v in ys])
    out[scheme] = (xs.mean(0), *bootstrap_mean(ys))
  return out


def plot(results: dict, path=None):
  """Success and reward vs env steps and wall-clock, mean turns: the mean
  over seeds, shaded over its 95% bootstrap interval."""
  panels = [("eval/success", "env_steps", "held-out success (greedy)"),
            ("rollout/success_frac", "env_steps", "rollout success (T=1)"),
            ("rollout/reward_mean", "env_steps", "rollout reward"),
            ("eval/success", "wall_s", "held-out success (greedy)"),
            ("rollout/success_frac", "wall_s", "rollout success (T=1)"),
            ("rollout/turns_mean", "env_steps", "turns per episode")]
  fig, axes = plt.subplots(2, 3, figsize=(16, 7.5))
  for ax, (key, x, label) in zip(axes.flat, panels):
    for scheme, (xs, mean, low, high) in curves(results, key, x).items():
      line, = ax.plot(xs, mean, label=scheme, marker="o", ms=3)
      ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.12)
    ax.set_xlabel("environment steps" if x == "env_steps" else "train wall-clock (s)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=8)
  fig.tight_layout()
  if path is not None:
    fig.savefig(path, dpi=110)
  return fig


def summary_table(results: dict) -> list[dict]:
  """Per scheme, mean over seeds: held-out greedy success at the SFT start and
  at the end (with its std), rollout success (T=1, the same training tasks
  for every scheme) over the first and last `window` iterations, and cost."""
  rows = []
  window = 10
  for scheme in dict.fromkeys(s for s, _ in results):
    runs = [rows_ for (s, _), rows_ in results.items() if s == scheme]
    start = [next(r["eval/success"] for r in run if r["step"] == 0) for run in runs]
    final = [[r for r in run if "eval/success" in r][-1]["eval/success"] for run in runs]
    rollout = [[r["rollout/success_frac"] for r in run if r["step"] > 0] for run in runs]
    rows.append({
        "scheme": scheme, "seeds": len(runs),
        "sft_success": float(np.mean(start)), "final_success": float(np.mean(final)),
        "final_std": float(np.std(final)),
        "rollout_first": float(np.mean([np.mean(v[:window]) for v in rollout])),
        "rollout_last": float(np.mean([np.mean(v[-window:]) for v in rollout])),
        "env_steps": float(np.mean([sum(r.get("rollout/env_steps", 0) for r in run)
                                    for run in runs])),
        "wall_s": float(np.mean([sum(r.get("time/iteration_s", 0) for r in run)
                                 for run in runs]))})
  return rows


def _per_turn(batch, num_trajs: int, num_turns: int) -> np.ndarray:
  """[N, T] advantage on each turn's tokens (NaN where a turn does not exist)."""
  out = np.full((num_trajs, num_turns), np.nan, np.float32)
  on = (batch.seq_ids >= 0) & (batch.turn_index >= 0)
  out[batch.seq_ids[on], batch.turn_index[on]] = batch.advantages[on]
  return out


class _Policy:
  """A config's model and rollout engine, loadable from any run's checkpoint."""

  def __init__(self, cfg):
    self.cfg = cfg
    self.model, self.sampler, self.engine, _, self.eval_tasks = train_agent.build(cfg)
    tx = train.make_optimizer(train.OptimConfig(**cfg.rl_optim))
    self.graphdef, state = train.init_train_state(self.model, tx, with_reference=False)
    self.abstract = jax.eval_shape(lambda: state)

  def load(self, workdir: pathlib.Path, step: int | None = None):
    """Restores a run's parameters (latest step by default) into the sampler."""
    ckpt = checkpointing.Checkpointer(workdir / "checkpoints")
    state, _ = ckpt.restore(ckpt.latest_step() if step is None else step,
                            abstract_state=self.abstract)
    ckpt.close()
    self.sampler.update_params(state.params)
    return state.params


def sampled_success(size: str, root, schemes=SCHEMES) -> dict:
  """Held-out success at temperature 1 (the policy RL optimises), as each
  run evaluated it (`eval_samples` episodes per held-out task, the sampling
  seed fixed by the seed: the same for every policy of a seed); "sft" is
  the shared start. Returns {(scheme or "sft", seed): success}."""
  root = pathlib.Path(root)
  out = {}
  for seed in SIZES[size]["seeds"]:
    for name in ("sft", *schemes):
      summary = json.loads((root / name / f"seed{seed}" / "summary.json").read_text())
      out[name, seed] = summary["sft_success_sampled" if name == "sft"
                                else "rl_success_sampled"]
  return out


def interval_table(size: str, root, results: dict, schemes=SCHEMES,
                   baseline: str = "grpo") -> list[dict]:
  """Per scheme, over seeds: held-out success greedy and at T = 1 (mean and
  95% bootstrap interval), and the paired difference against `baseline`
  on the same seeds (mean, interval, and whether it excludes 0)."""
  sampled = sampled_success(size, root, schemes)
  seeds = SIZES[size]["seeds"]
  greedy = {}
  for scheme in schemes:
    greedy[scheme] = [[r for r in results[scheme, s] if "eval/success" in r][-1]["eval/success"]
                      for s in seeds]
  greedy["sft"] = [next(r["eval/success"] for r in results[schemes[0], s] if r["step"] == 0)
                   for s in seeds]
  rows = []
  for name in ("sft", *schemes):
    row = {"scheme": name, "seeds": len(seeds)}
    for kind, values in (("greedy", greedy), ("t1", {n: [sampled[n, s] for s in seeds]
                                                      for n in ("sft", *schemes)})):
      row[kind] = bootstrap_mean(values[name])
      if name not in ("sft", baseline):
        diff = bootstrap_mean(np.subtract(values[name], values[baseline]))
        row[f"{kind}_diff"] = diff
        row[f"{kind}_distinct"] = bool(diff[1] > 0 or diff[2] < 0)
    rows.append(row)
  return rows


def example_advantages(size: str, root, schemes=SCHEMES, *, seed: int = 0,
                       num_tasks: int = 2, group_size: int = 4) -> dict:
  """The per-turn advantages every scheme assigns to the same trajectories.

  The trajectories are sampled by the shared SFT policy on held-out maps; a
  scheme that needs values reads the value head the "gae" run trained, one
  that needs branches gets continuations sampled by the SFT policy. Returns
  {"turn_rewards": [N, T], "success": [N], scheme: [N, T] advantages (NaN
  past an episode's end)}, and writes the episodes under each scheme (its
  label) to `<root>/trajectories.jsonl` for `experiments/view.py`.
  """
  root = pathlib.Path(root)
  policy = _Policy(config("grpo", seed, size))
  cfg, engine = policy.cfg, policy.engine
  critic = nnx.merge(policy.graphdef, policy.load(root / "gae" / f"seed{seed}"))
  policy.load(root / "sft" / f"seed{seed}", 0)
  tasks = policy.eval_tasks[:num_tasks]
  trajs = engine.run(tasks, group_size, seed=seed).trajectories
  batch = collate(trajs, buckets=cfg.rl.buckets)
  turns = cfg.rollout.max_turns
  common = dict(gamma=cfg.rl.gamma, lam=cfg.rl.lam, num_turns=turns)
  reward_rows, _ = turn_arrays(trajs, turns)
  out = {"turn_rewards": reward_rows,
         "success": np.asarray([t.metadata["success"] for t in trajs])}
  hidden, _ = critic.hidden_states(batch.tokens, batch.positions, seq_ids=batch.seq_ids)
  values = np.asarray(critic.values(hidden))
  branch_values, _, _ = rl.branch_values_of(engine, tasks, trajs, cfg.rl.branch_size,
                                            gamma=cfg.rl.gamma, seed=seed + 1)
  records = []
  for scheme in schemes:
    # A named algorithm's arm credits with its estimator (dapo: grpo's).
    estimator = presets.PRESETS[scheme].credit if scheme in presets.PRESETS else scheme
    credited = credit.assign(estimator, trajs, batch, token_values=values,
                             branch_values=branch_values, **common)
    out[scheme] = _per_turn(credited, len(trajs), turns)
    records += [viewer.episode_record(t, engine.tok, iteration=0, phase="example",
                                      batch=credited, seq=i, label=scheme)
                for i, t in enumerate(trajs)]
  viewer.write_jsonl(root / "trajectories.jsonl", records, append=False)
  engine.close()
  return out


def plot_advantages(example: dict, path=None, per_row: int = 5):
  """Heatmaps: turn rewards, then each scheme's per-turn advantages."""
  keys = [k for k in example if k != "success"]
  rows = -(-len(keys) // per_row)
  fig, axes = plt.subplots(rows, per_row, figsize=(3.2 * per_row, 3.6 * rows), sharey=True,
                           squeeze=False)
  label = "trajectory (" + ", ".join("S" if s else "F" for s in example["success"]) + ")"
  for ax in axes.flat[len(keys):]:
    ax.axis("off")
  for ax, key in zip(axes.flat, keys):
    data = example[key].copy()
    if key == "turn_rewards":
      data[np.isnan(example["grpo"])] = np.nan
    lim = np.nanmax(np.abs(data)) or 1.0
    im = ax.imshow(data, cmap="coolwarm", vmin=-lim, vmax=lim, aspect="auto")
    for (i, j), v in np.ndenumerate(data):
      if not np.isnan(v):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
    ax.set_title(key, fontsize=9)
    ax.set_xlabel("turn")
    fig.colorbar(im, ax=ax, fraction=0.05)
  for ax in axes[:, 0]:
    ax.set_ylabel(label, fontsize=8)
  fig.tight_layout()
  if path is not None:
    fig.savefig(path, dpi=110)
  return fig


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--size", choices=sorted(SIZES), default="full")
  p.add_argument("--root", default="runs/credit_ablation")
  args = p.parse_args()
  results = run(args.size, args.root)
  for row in summary_table(results):
    print(row)
  print(sampled_success(args.size, args.root))
  plot(results, pathlib.Path(args.root) / "ablation.png")
  plot_advantages(example_advantages(args.size, args.root),
                  pathlib.Path(args.root) / "advantages.png")


if __name__ == "__main__":
  main()
