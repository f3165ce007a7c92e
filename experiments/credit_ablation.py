"""Credit-assignment ablation: one RL run per arm from the same SFT start.

Drives `notebooks/credit_assignment.ipynb`; also runs as a script:

  python experiments/credit_ablation.py --env=frozen_lake --size=full
  python experiments/credit_ablation.py --env=sokoban --arms=gigpo,obs_loss --seeds=0,1

For each seed, SFT runs once (`<root>/sft/seed<k>`, a `train_agent` run with
0 RL iterations); every arm's run (`<root>/<arm>/seed<k>`) starts from a
copy of that workdir, so all arms resume from the identical SFT checkpoint
and see the same tasks in the same order. The model always has a value
head (only "gae" trains it), so the checkpoint fits every arm. Finished
runs are reused, so an interrupted ablation picks up where it was.

Every arm is compared with the `grpo` arm (GRPO as DeepSeekMath defines it,
the `grpo` preset: seq-mean-token-mean, clip 0.2 / 0.2, no filtering), and
each comparison changes one thing (`ARMS`):

  estimator   another advantage estimator (`rl.credit`) under grpo's loss,
              aggregation and clip: only the credit differs;
  algorithm   another named algorithm (`presets`): its whole recipe
              (estimator, aggregation, normaliser, filtering, clip);
  masking     grpo with the policy loss on observation tokens too
              (`rl.observation_loss`), against the masked default.

`VARIANTS` run only when `--arms` names them: `gae_detached` is `gae` with
its value head trained on the policy's stopped hidden states
(`loss.value_detach`).

A credit scheme registered by name (`credit.register`) is an estimator arm
too. Environments (`ENVS`): text FrozenLake with the shaped per-turn reward
(0.1 per cell closer to the goal), gamma 0.9
(`configs/frozen_lake_turn_credit.py`), text Sokoban with the outcome
reward alone (`configs/sokoban.py`), 6x6 FrozenLake with the outcome
reward alone over up to 12 turns (`configs/frozen_lake_6x6.py`), and the
warehouse tool task, JSON tool calls and their results as observations
(`configs/tools_example.py`).
"""

import argparse
import dataclasses
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
from configs import frozen_lake_6x6, frozen_lake_turn_credit, sokoban, tools_example  # pylint: disable=wrong-import-position,line-too-long
import train_agent  # pylint: disable=wrong-import-position

BASELINE = "grpo"


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm: a named algorithm (`presets`) and the fields it sets over it."""

  comparison: str  # "baseline", "estimator", "algorithm" or "masking"
  algorithm: str = BASELINE
  fields: tuple[tuple[str, object], ...] = ()


def _estimator(name: str, *fields) -> Arm:
  return Arm("estimator", fields=(("rl.credit", name), *fields))


ARMS = {
    BASELINE: Arm("baseline"),
    "rloo": _estimator("rloo"),
    "turn_returns": _estimator("turn_returns"),
    "gae": _estimator("gae", ("loss.value_coef", 0.5)),
    "branching": _estimator("branching"),
    "gigpo": _estimator("gigpo"),
    "drgrpo": Arm("algorithm", "drgrpo"),
    "dapo": Arm("algorithm", "dapo"),
    "obs_loss": Arm("masking", fields=(("rl.observation_loss", True),)),
}
ARM_NAMES = tuple(ARMS)
# Arms run only when named (`--arms`): variants of an arm above.
VARIANTS = {
    # gae with the value loss stopped at the head (`loss.value_detach`): a
    # fresh head's gradient cannot reach the policy's trunk.
    "gae_detached": _estimator("gae", ("loss.value_coef", 0.5), ("loss.value_detach", True)),
}

ENVS = {"frozen_lake": frozen_lake_turn_credit.get_config, "sokoban": sokoban.get_config,
        "tools": tools_example.get_config, "frozen_lake_6x6": frozen_lake_6x6.get_config}

_TINY = {"iterations": 2, "eval_every": 1, "checkpoint_every": 100,
         "sft.steps": 4, "sft.num_demos": 8, "sft.batch_size": 4,
         "env.num_train_tasks": 40, "env.num_eval_tasks": 4,
         "rl.tasks_per_iteration": 2, "rl.group_size": 2, "sampler.num_slots": 8}

# Per environment and size: the seeds and the overrides of its config.
SIZES = {
    "frozen_lake": {
        # A few minutes on 2 CPU cores: the test suite executes the notebook so.
        "tiny": dict(seeds=(0,), overrides=_TINY),
        # The real comparison (runtime on this CPU: see docs/results.md).
        # SFT, the RL batch and the optimiser are pinned to the committed
        # notebook's run, made before default.py changed them.
        "full": dict(seeds=tuple(range(8)), overrides={
            "iterations": 30, "eval_every": 5, "checkpoint_every": 100,
            "env.num_eval_tasks": 64, "rl.tasks_per_iteration": 4, "rl.group_size": 8,
            "sft.steps": 150, "sft.num_demos": 256, "loss.ppo_epochs": 1,
            "rl_optim.learning_rate": 1e-4, "rl_optim.total_steps": 200}),
    },
    # Sokoban (its rooms take 4+ moves: the turn budget stays the config's)
    # and the tool task: `full` is the config's own run, 8 seeds (runtime on
    # this CPU: docs/results.md).
    **{env: {"tiny": dict(seeds=(0,), overrides=_TINY),
             "full": dict(seeds=tuple(range(8)), overrides={"checkpoint_every": 100})}
       for env in ("sokoban", "tools")},
    # 6x6 FrozenLake: the config's SFT; RL samples at 1.3, since at 1.0 the
    # SFT policy's groups of 8 all succeed or all fail on half the
    # iterations (no gradient); one PPO epoch and a held-out evaluation at
    # the end only, for time (runtime on this CPU: docs/results.md).
    "frozen_lake_6x6": {
        "tiny": dict(seeds=(0,), overrides=_TINY),
        "full": dict(seeds=tuple(range(8)), overrides={
            "checkpoint_every": 100, "rollout.temperature": 1.3, "loss.temperature": 1.3,
            "loss.ppo_epochs": 1,
            "eval_every": 60})},
}


def arm(name: str) -> Arm:
  """The arm `name`: a built-in one, a variant, or a registered credit scheme's
  estimator arm."""
  if name in ARMS:
    return ARMS[name]
  if name in VARIANTS:
    return VARIANTS[name]
  if name in credit.schemes():
    return _estimator(name)
  raise ValueError(f"unknown arm {name!r}: one of {ARM_NAMES + tuple(VARIANTS)} or a "
                   f"registered credit scheme {credit.schemes()}")


def config(name: str, seed: int, size: str, env: str = "frozen_lake"):
  """The config of arm `name` on `env`, resolved: its algorithm's preset,
  then the arm's own fields (`arm_fields` names them, for `train_agent.run`
  to keep over the preset)."""
  a = arm(name)
  cfg = ENVS[env]()
  cfg.seed = seed
  cfg.algorithm = a.algorithm
  cfg.model.value_head = True
  # Whole-cache decode, as when the committed notebook ran (see default.py).
  cfg.sampler.attention_windows = (cfg.sampler.cache_length,)
  for key, value in (*SIZES[env][size]["overrides"].items(), *a.fields):
    node = cfg
    *path, leaf = key.split(".")
    for part in path:
      node = node[part]
    if leaf not in node:  # ConfigDict would add a misspelt field and ignore it
      raise ValueError(f"{env} {size}: no config field {key!r}")
    node[leaf] = value
  return presets.apply(cfg, a.algorithm, keep=arm_fields(name))


def arm_fields(name: str) -> tuple[str, ...]:
  """The config fields arm `name` sets over its algorithm's preset."""
  return tuple(key for key, _ in arm(name).fields)


def _done(workdir: pathlib.Path) -> bool:
  return (workdir / "summary.json").exists()


def run(size: str, root, arms=ARM_NAMES, *, env: str = "frozen_lake", seeds=None) -> dict:
  """Runs (or reuses) every (arm, seed), the `grpo` baseline always among
  them; returns their metric rows {(arm, seed): rows}. seeds: the size's
  by default.

  The runs share a persistent compilation cache (`<root>/jax_cache`): every
  run builds the same programs, so only the first to need one compiles it
  and the others' wall-clock holds little compile time.
  """
  root = pathlib.Path(root)
  arms = tuple(dict.fromkeys((BASELINE, *arms)))
  for name in arms:
    arm(name)  # an unknown name fails before any work
  jax.config.update("jax_compilation_cache_dir", str(root / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  results = {}
  for seed in SIZES[env][size]["seeds"] if seeds is None else seeds:
    sft_dir = root / "sft" / f"seed{seed}"
    if not _done(sft_dir):
      cfg = config(BASELINE, seed, size, env)
      cfg.iterations = 0
      train_agent.run(cfg, sft_dir)
    for name in arms:
      workdir = root / name / f"seed{seed}"
      if not _done(workdir):
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        shutil.copytree(sft_dir / "checkpoints", workdir / "checkpoints")
        shutil.copy(sft_dir / "metrics.jsonl", workdir / "metrics.jsonl")
        train_agent.run(config(name, seed, size, env), workdir, explicit=arm_fields(name))
      results[name, seed] = metrics.read_metrics(workdir)
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
  """Per arm: (x [n], mean [n], low [n], high [n]) over seeds of `key` at
  RL steps: the mean and its 95% bootstrap interval over seeds.

  x: "env_steps" (cumulative environment steps sampled, branch
  continuations included) or "wall_s" (cumulative seconds of rollouts,
  credit assignment and train steps, evaluation excluded). Step 0 is the
  shared SFT start.
  """
  out = {}
  for name in dict.fromkeys(s for s, _ in results):
    xs, ys = [], []
    for (s, _), rows in results.items():
      if s != name:
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
    out[name] = (xs.mean(0), *bootstrap_mean(ys))
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
    for name, (xs, mean, low, high) in curves(results, key, x).items():
      line, = ax.plot(xs, mean, label=name, marker="o", ms=3)
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
  """Per arm, mean over seeds: held-out greedy success at the SFT start and
  at the end (with its std), rollout success (T=1, the same training tasks
  for every arm) over the first and last 10 iterations (a third of the
  iterations when there are fewer than 30, so the windows never overlap),
  and cost."""
  rows = []
  for name in dict.fromkeys(s for s, _ in results):
    runs = [rows_ for (s, _), rows_ in results.items() if s == name]
    start = [next(r["eval/success"] for r in run if r["step"] == 0) for run in runs]
    final = [[r for r in run if "eval/success" in r][-1]["eval/success"] for run in runs]
    rollout = [[r["rollout/success_frac"] for r in run if r["step"] > 0] for run in runs]
    window = max(1, min(10, min(map(len, rollout)) // 3))
    rows.append({
        "arm": name, "seeds": len(runs),
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
    # A LoRA run's checkpoints hold the adapters alone; the base is this one.
    self.frozen = state.frozen
    self.abstract = jax.eval_shape(lambda: train.checkpointed(state))
    # A run with a KL term (loss.kl_beta > 0) also saved its reference,
    # which restores only into a tree that has one.
    self.abstract_ref = jax.eval_shape(
        lambda: train.reference_params(state.params, cfg.model.dtype))

  def load(self, workdir: pathlib.Path, step: int | None = None):
    """Restores a run's whole model's parameters (latest step by default)
    into the sampler and returns them."""
    ckpt = checkpointing.Checkpointer(workdir / "checkpoints")
    step = ckpt.latest_step() if step is None else step
    saved_ref = ckpt.saved_tree(step).get("ref_params") is not None
    state, _ = ckpt.restore(step, abstract_state=self.abstract.replace(
        ref_params=self.abstract_ref if saved_ref else None))
    ckpt.close()
    params = state.replace(frozen=self.frozen).model_params
    self.sampler.update_params(params)
    return params


def _seeds(results: dict) -> list[int]:
  return sorted({seed for _, seed in results})


def held_out(root, results: dict, key: str = "success_sampled") -> dict:
  """A held-out metric of each run's summary.json at its end, and of the
  shared SFT start as "sft": {(arm or "sft", seed): value}. key:
  "success_sampled" (success at temperature 1, the policy RL optimises:
  `eval_samples` episodes per held-out task, the sampling seed fixed by the
  seed, so the same for every policy of a seed) or "pass_at_<k>"."""
  root = pathlib.Path(root)
  out = {}
  for seed in _seeds(results):
    for name in ("sft", *dict.fromkeys(a for a, _ in results)):
      summary = json.loads((root / name / f"seed{seed}" / "summary.json").read_text())
      out[name, seed] = summary[f"sft_{key}" if name == "sft" else f"rl_{key}"]
  return out


def interval_table(root, results: dict, *, pass_key: str | None = None) -> list[dict]:
  """Per arm, over seeds: held-out success greedy ("greedy") and at T = 1
  ("t1"), and pass@k ("pass", with `pass_key`, e.g. "pass_at_4"): the mean
  and its 95% bootstrap interval; and for every arm but the baseline the
  paired difference against `grpo` on the same seeds (mean, interval,
  "<kind>_distinct": whether it excludes 0). The first row is the shared
  SFT start; "comparison" says which comparison an arm belongs to."""
  seeds = _seeds(results)
  arms = tuple(dict.fromkeys(a for a, _ in results))
  greedy = {name: [[r for r in results[name, s] if "eval/success" in r][-1]["eval/success"]
                   for s in seeds] for name in arms}
  greedy["sft"] = [next(r["eval/success"] for r in results[BASELINE, s] if r["step"] == 0)
                   for s in seeds]
  kinds = {"greedy": greedy}
  for kind, key in (("t1", "success_sampled"), ("pass", pass_key)):
    if key is not None:
      values = held_out(root, results, key)
      kinds[kind] = {n: [values[n, s] for s in seeds] for n in ("sft", *arms)}
  rows = []
  for name in ("sft", *arms):
    row = {"arm": name, "seeds": len(seeds),
           "comparison": "start" if name == "sft" else arm(name).comparison}
    for kind, values in kinds.items():
      row[kind] = bootstrap_mean(values[name])
      if name not in ("sft", BASELINE):
        diff = bootstrap_mean(np.subtract(values[name], values[BASELINE]))
        row[f"{kind}_diff"] = diff
        row[f"{kind}_distinct"] = bool(diff[1] > 0 or diff[2] < 0)
    rows.append(row)
  return rows


def format_table(rows: list[dict]) -> str:
  """`interval_table`'s rows as text, grouped by comparison; `*` marks a
  paired interval that excludes 0."""
  kinds = [k for k in ("greedy", "t1", "pass") if k in rows[0]]
  label = {"greedy": "greedy", "t1": "T = 1", "pass": "pass@k"}
  ci = lambda v: f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"
  lines = [f"{rows[0]['seeds']} seeds; mean [95% bootstrap interval]; paired difference "
           f"against {BASELINE} on the same seeds (* excludes 0)",
           f"{'arm':13s} {'comparison':10s} " + " ".join(
               f"{label[k]:>22s} {label[k] + ' - ' + BASELINE:>26s}" for k in kinds)]
  for r in sorted(rows, key=lambda r: ("start", "baseline", "estimator", "algorithm",
                                       "masking").index(r["comparison"])):
    cells = []
    for k in kinds:
      d = r.get(f"{k}_diff")
      cells.append(f"{ci(r[k]):>22s} " + (f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]"
                                           + ("*" if r[f"{k}_distinct"] else " ")
                                           if d is not None else "").rjust(26))
    lines.append(f"{r['arm']:13s} {r['comparison']:10s} " + " ".join(cells))
  return "\n".join(lines)


def example_advantages(size: str, root, arms=ARM_NAMES, *, env: str = "frozen_lake",
                       seed: int = 0, num_tasks: int = 2, group_size: int = 4) -> dict:
  """The per-turn advantages every arm's estimator assigns to the same
  trajectories (a masking arm is left out: its advantages are grpo's).

  The trajectories are sampled by the shared SFT policy on held-out tasks; a
  scheme that needs values reads the value head the "gae" run trained, one
  that needs branches gets continuations sampled by the SFT policy. Returns
  {"turn_rewards": [N, T], "success": [N], arm: [N, T] advantages (NaN
  past an episode's end)}, and writes the episodes under each arm (its
  label) to `<root>/trajectories.jsonl` for `experiments/view.py`.
  """
  root = pathlib.Path(root)
  policy = _Policy(config(BASELINE, seed, size, env))
  cfg, engine = policy.cfg, policy.engine
  estimators = {name: config(name, seed, size, env).rl.credit for name in arms
                if arm(name).comparison != "masking"}
  values = branch_values = None
  needs_values = any(credit.scheme(e).needs_values for e in estimators.values())
  if needs_values:
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
  if needs_values:
    hidden, _ = critic.hidden_states(batch.tokens, batch.positions, seq_ids=batch.seq_ids,
                                     prefix_ids=batch.prefix_ids)
    values = np.asarray(critic.values(hidden))
  if any(credit.scheme(e).needs_branches for e in estimators.values()):
    branch_values, _, _ = rl.branch_values_of(engine, tasks, trajs, cfg.rl.branch_size,
                                              gamma=cfg.rl.gamma, seed=seed + 1)
  records = []
  for name, estimator in estimators.items():  # a preset's arm: its estimator (dapo: grpo)
    credited = credit.assign(estimator, trajs, batch, token_values=values,
                             branch_values=branch_values, **common)
    out[name] = _per_turn(credited, len(trajs), turns)
    records += [viewer.episode_record(t, engine.tok, iteration=0, phase="example",
                                      batch=credited, seq=i, label=name)
                for i, t in enumerate(trajs)]
  viewer.write_jsonl(root / "trajectories.jsonl", records, append=False)
  engine.close()
  return out


def plot_advantages(example: dict, path=None, per_row: int = 5):
  """Heatmaps: turn rewards, then each arm's per-turn advantages."""
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
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--env", choices=sorted(ENVS), default="frozen_lake")
  p.add_argument("--size", default="full", help="a size of the env's SIZES")
  p.add_argument("--arms", default=",".join(ARM_NAMES),
                 help="comma-separated arms (grpo, the baseline, always runs)")
  p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the size's)")
  p.add_argument("--root", default=None, help="default: runs/credit_ablation/<env>")
  args = p.parse_args()
  if args.size not in SIZES[args.env]:
    p.error(f"--size for {args.env}: one of {sorted(SIZES[args.env])}")
  root = pathlib.Path(args.root or f"runs/credit_ablation/{args.env}")
  seeds = None if args.seeds is None else [int(s) for s in args.seeds.split(",")]
  results = run(args.size, root, args.arms.split(","), env=args.env, seeds=seeds)
  for row in summary_table(results):
    print(row)
  cfg = config(BASELINE, _seeds(results)[0], args.size, args.env)
  print(format_table(interval_table(root, results, pass_key=(
      f"pass_at_{cfg.eval_samples}" if cfg.eval_samples > 1 else None))))
  plot(results, root / "ablation.png")


if __name__ == "__main__":
  main()
