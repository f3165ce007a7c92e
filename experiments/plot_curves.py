"""Learning curves from one or more workdirs' metrics.jsonl, as one PNG.

  python experiments/plot_curves.py --workdirs=runs/a,runs/b --out=curves.png \
      --keys=eval/success,train/reward_mean --x=step

One subplot per metric key, one line per run (labelled by the workdir's
basename, or its path where basenames repeat). Without --keys every key found in any run is drawn. The training
script calls `plot` itself to leave `<workdir>/curves.png` behind.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from absl import app, flags
# Figure + savefig renders through Agg without pyplot, so no global backend
# state is touched and this works on a headless machine.
from matplotlib.figure import Figure

from agentrl_jax.metrics import read_metrics

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Run directories to compare.")
_OUT = flags.DEFINE_string("out", "curves.png", "PNG to write.")
_KEYS = flags.DEFINE_list("keys", None, "Metric keys (default: all).")
_X = flags.DEFINE_enum("x", "step", ["step", "time"],
                       "x axis: training step or seconds since the first record.")


def plot(runs: dict[str, list[dict]], keys: Sequence[str] | None,
         out_path: str, x: str = "step") -> None:
  """Draws `keys` (default: all) of every run in `runs` (label -> records).

  A key a run never logged is skipped for that run; keys no run logged are
  left out. x="time" plots seconds since each run's first record.
  """
  if x not in ("step", "time"):
    raise ValueError(f"x must be 'step' or 'time', not {x!r}")
  logged = {k for records in runs.values() for r in records for k in r}
  if keys is None:
    keys = sorted(logged - {"step", "time"})
  keys = [k for k in keys if k in logged]
  if not keys:
    raise ValueError("none of the requested metrics were logged")
  ncols = min(3, len(keys))
  nrows = math.ceil(len(keys) / ncols)
  fig = Figure(figsize=(5 * ncols, 3.5 * nrows), layout="constrained")
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  for ax, key in zip(axes, keys):
    # A fixed colour per run, so a run keeps its colour in every subplot.
    for i, (label, records) in enumerate(runs.items()):
      points = [r for r in records if key in r and r[key] is not None]
      if not points:
        continue
      t0 = records[0]["time"]
      xs = [r["step"] if x == "step" else r["time"] - t0 for r in points]
      ax.plot(xs, [r[key] for r in points], color=f"C{i % 10}", label=label)
    ax.set_title(key)
    ax.set_xlabel("step" if x == "step" else "seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
  for ax in axes[len(keys):]:
    ax.set_visible(False)
  fig.savefig(out_path, dpi=100)


def main(argv: Sequence[str]) -> None:
  del argv
  labels = [os.path.basename(os.path.normpath(w)) for w in _WORKDIRS.value]
  if len(set(labels)) < len(labels):  # e.g. a/seed0 and b/seed0
    labels = list(_WORKDIRS.value)
  runs = {label: read_metrics(w) for label, w in zip(labels, _WORKDIRS.value)}
  plot(runs, _KEYS.value, _OUT.value, x=_X.value)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  flags.mark_flag_as_required("workdirs")
  app.run(main)
