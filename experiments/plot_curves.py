"""Learning curves and the run report from workdirs' metrics.jsonl, as one PNG.

  python experiments/plot_curves.py --workdirs=runs/a,runs/b --out=report.png
  python experiments/plot_curves.py --workdirs=runs/grpo/seed0,runs/grpo/seed1,runs/gae/seed0 \
      --keys=eval/success,rollout/reward_mean --x=time

One line per run, labelled by the workdir's basename; workdirs named
`seed<k>` are seeds of the run their parent names, drawn as the mean over
seeds with the range between the lowest and the highest seed shaded.
Without --keys the run report is drawn (`REPORT`: the panels to check first
when a run goes wrong); --keys=all draws every logged key, one panel each;
a key no run logged is an error.
Per-iteration metrics are smoothed (an exponential moving average) over
their raw values drawn faint; evaluations are drawn as measured. The
training script calls `report` itself to leave `<workdir>/curves.png`.
"""

from __future__ import annotations

import collections
import math
import os
import re
from typing import Sequence

from absl import app, flags
# Figure + savefig renders through Agg without pyplot, so no global backend
# state is touched and this works on a headless machine.
from matplotlib.figure import Figure
import numpy as np

from agentrl_jax import losses
from agentrl_jax.metrics import read_metrics

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Run directories to compare.")
_OUT = flags.DEFINE_string("out", "curves.png", "PNG to write.")
_KEYS = flags.DEFINE_list("keys", None, "Metric keys; 'all': every logged key; "
                          "default: the run report.")
_X = flags.DEFINE_enum("x", "step", ["step", "time"],
                       "x axis: training step or seconds since the first record.")

# (title, keys): the run report's panels; a panel none of whose keys a run
# logged is left out.
REPORT = (
    ("held-out success (greedy; T = 1 dashed)", ("eval/success", "eval/success_sampled")),
    ("rollout reward", ("rollout/reward_mean",)),
    ("rollout success (at the sampler's temperature)", ("rollout/success_frac",)),
    ("turns per episode", ("rollout/turns_mean",)),
    # Hot samplers and young policies write unparseable actions; each costs a turn.
    ("malformed actions (fraction of turns)", ("rollout/malformed_turn_frac",)),
    ("policy loss", ("train/pg_loss",)),
    ("KL term to the reference (its gradient's divergence)",
     tuple(f"train/{losses.kl_metric_name(k)}" for k in losses.LOSS_KL_KINDS)),
    ("entropy of the policy on its actions", ("train/policy_entropy", "train/entropy")),
    # The first PPO epoch's ratios start at 1; with several epochs the last
    # one's show how far the update moved the policy.
    ("clip fractions (first and last PPO epoch)",
     ("train/clip_frac_lower", "train/clip_frac_upper", "train/dual_clip_frac",
      "train/clip_frac_lower_last_epoch", "train/clip_frac_upper_last_epoch")),
    ("gradient norm", ("train/grad_norm",)),
    ("sampler vs trainer log-prob gap", ("train/logprob_gap_mean_abs", "train/logprob_gap_kl")),
    ("kept fraction after filtering", ("rollout/kept_frac",)),
    ("action tokens per iteration", ("train/batch_tokens",)),
    ("seconds per iteration", ("time/iteration_s", "rollout/generation_s",
                               "rollout/env_wait_s", "time/step_s")),
    ("SFT loss", ("sft/sft_loss",)),
)
_STYLES = ("-", "--", ":", "-.", (0, (3, 1, 1, 1, 1, 1)))
_SMOOTH = 0.8  # EMA weight of the past
_SEED = re.compile(r"seed\d+$")


def group_seeds(workdirs: Sequence[str]) -> dict[str, list[list[dict]]]:
  """label -> the metric records of each of its seeds; `.../name/seed<k>`
  workdirs are seeds of `name`, any other workdir is a run of its own."""
  names = []
  for w in workdirs:
    parts = os.path.normpath(w).split(os.sep)
    names.append(parts[-2] if _SEED.match(parts[-1]) and len(parts) > 1 else parts[-1])
  if len(set(names)) < len(names) and not any(_SEED.match(os.path.basename(os.path.normpath(w)))
                                             for w in workdirs):
    names = list(workdirs)  # e.g. a/run and b/run: tell them apart by path
  runs = collections.defaultdict(list)
  for name, w in zip(names, workdirs):
    runs[name].append(read_metrics(w))
  return dict(runs)


def _smoothed(ys: np.ndarray) -> np.ndarray:
  out, acc = np.empty_like(ys), None
  for i, y in enumerate(ys):
    acc = y if acc is None else _SMOOTH * acc + (1 - _SMOOTH) * y
    out[i] = acc
  return out


def _series(seeds: list[list[dict]], key: str, x: str):
  """(xs, mean, low, high) over the steps every seed logged `key` at."""
  by_seed = []
  for records in seeds:
    t0 = records[0]["time"] if records else 0.0
    by_seed.append({r["step"]: (r["step"] if x == "step" else r["time"] - t0, r[key])
                    for r in records if r.get(key) is not None})
  steps = sorted(set.intersection(*(set(s) for s in by_seed))) if by_seed else []
  if not steps:
    return None
  xs = np.asarray([[s[k][0] for k in steps] for s in by_seed], np.float64).mean(0)
  ys = np.asarray([[s[k][1] for k in steps] for s in by_seed], np.float64)
  return xs, ys.mean(0), ys.min(0), ys.max(0)


def _draw(ax, runs: dict[str, list[list[dict]]], keys: Sequence[str], x: str) -> bool:
  """Draws `keys` of every run on `ax`; False if none was logged."""
  drawn = False
  for i, (label, seeds) in enumerate(runs.items()):
    colour = f"C{i % 10}"  # a run keeps its colour in every panel
    for style, key in zip(_STYLES, keys):
      series = _series(seeds, key, x)
      if series is None:
        continue
      xs, mean, low, high = series
      name = label if len(keys) == 1 else f"{label}: {key.split('/')[-1]}"
      per_iteration = not key.startswith(("eval/", "sft/"))
      if per_iteration and len(xs) > 2:
        ax.plot(xs, mean, color=colour, ls=style, alpha=0.25, lw=0.8)
        mean, low, high = _smoothed(mean), _smoothed(low), _smoothed(high)
      ax.plot(xs, mean, color=colour, ls=style, label=name,
              marker=None if per_iteration else "o", ms=3)
      if len(seeds) > 1:
        ax.fill_between(xs, low, high, color=colour, alpha=0.15)
      drawn = True
  return drawn


def _logged(runs: dict[str, list[list[dict]]]) -> set[str]:
  """Every key any record of any run holds."""
  return {k for seeds in runs.values() for records in seeds for r in records for k in r}


def plot(runs: dict[str, list[list[dict]]], panels: Sequence[tuple[str, Sequence[str]]],
         out_path: str, x: str = "step") -> None:
  """Draws `panels` ((title, keys) each) for every run (label -> its seeds'
  records); a panel no run logged is left out."""
  if x not in ("step", "time"):
    raise ValueError(f"x must be 'step' or 'time', not {x!r}")
  logged = _logged(runs)
  panels = [(t, keys) for t, keys in panels if set(keys) & logged]
  if not panels:
    raise ValueError("none of the requested metrics were logged")
  ncols = min(4, len(panels))
  nrows = math.ceil(len(panels) / ncols)
  fig = Figure(figsize=(4.6 * ncols, 3.2 * nrows), layout="constrained")
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  for ax, (title, keys) in zip(axes, panels):
    _draw(ax, runs, keys, x)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step" if x == "step" else "seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")
  for ax in axes[len(panels):]:
    ax.set_visible(False)
  fig.savefig(out_path, dpi=100)


def report_panels(runs: dict[str, list[list[dict]]]) -> list[tuple[str, tuple[str, ...]]]:
  """`REPORT`, with held-out pass@k next to avg@k (T = 1) after the first
  panel where a run logged `eval/pass_at_<k>` (k = its eval_samples)."""
  logged = _logged(runs)
  pass_keys = tuple(sorted(k for k in logged if k.startswith("eval/pass_at_")))
  if not pass_keys:
    return list(REPORT)
  return [REPORT[0], ("held-out pass@k and avg@k (T = 1)",
                      pass_keys[:len(_STYLES) - 1] + ("eval/success_sampled",)), *REPORT[1:]]


def report(runs: dict[str, list[list[dict]]], out_path: str, x: str = "step") -> None:
  """The run report's panels (`report_panels`)."""
  plot(runs, report_panels(runs), out_path, x=x)


def main(argv: Sequence[str]) -> None:
  del argv
  runs = group_seeds(_WORKDIRS.value)
  if _KEYS.value is None:
    panels = report_panels(runs)
  else:
    logged = _logged(runs) - {"step", "time"}
    keys = sorted(logged) if _KEYS.value == ["all"] else _KEYS.value
    missing = [k for k in keys if k not in logged]
    if missing:  # a misspelt key would otherwise drop its panel without a word
      raise app.UsageError(f"no run logged {missing}; the runs logged: {sorted(logged)}")
    panels = [(k, (k,)) for k in keys]
  plot(runs, panels, _OUT.value, x=_X.value)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  flags.mark_flag_as_required("workdirs")
  app.run(main)
