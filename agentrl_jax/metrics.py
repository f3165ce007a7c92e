"""Scalar metrics to `<workdir>/metrics.jsonl` and TensorBoard (`<workdir>/tb`).

The JSONL file is the source of truth (plots and tests read it); TensorBoard
is for watching a run live. Each `write` appends one line
`{"step": 12, "time": <unix seconds>, "train/loss": 0.5, ...}` and flushes,
so a crash loses at most a half-written last line, which `read_metrics`
drops.

Non-finite values (nan, +-inf) are written as JSON `null`, since strict JSON
has no NaN, and read back as `nan`; TensorBoard gets the raw value.
"""

from __future__ import annotations

import json
import math
import os
import time

import tensorboardX

FILENAME = "metrics.jsonl"
_RESERVED = ("step", "time")


def _parse(path: str) -> list[dict]:
  """The records in `path`, without a truncated last line."""
  with open(path) as f:
    lines = f.read().split("\n")
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      if any(rest.strip() for rest in lines[i + 1:]):
        raise ValueError(f"{path}:{i + 1} is not JSON: {line[:80]!r}")
  return records


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
  """Every record of `<workdir>/metrics.jsonl` in write order; nulls as nan."""
  records = _parse(os.path.join(workdir, FILENAME))
  return [{k: math.nan if v is None else v for k, v in r.items()}
          for r in records]


class MetricsWriter:
  """Appends scalar metrics to a workdir's JSONL file and TensorBoard log.

  resume_step: when a run restarts from its checkpoint at step k, pass k: the
    lines with step > k (written after that checkpoint by the crashed run)
    are dropped, and TensorBoard is told to purge its events past k, so no
    step appears twice. Without it an existing file is appended to (after
    dropping a truncated last line, so the next record starts a fresh line).
  """

  def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True,
               resume_step: int | None = None):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, FILENAME)
    if os.path.exists(self.path):
      self._rewrite(resume_step)
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      purge = None if resume_step is None else resume_step + 1
      # tensorboardX names event files by the second and opens them "wb": a
      # writer reopened within the same second would erase the old events.
      self._tb = tensorboardX.SummaryWriter(
          os.path.join(workdir, "tb"), purge_step=purge, flush_secs=10,
          filename_suffix=f".{time.time_ns()}")

  def _rewrite(self, resume_step: int | None) -> None:
    """Drops records past `resume_step` and any truncated last line."""
    records = _parse(self.path)
    if resume_step is not None:
      records = [r for r in records if r["step"] <= resume_step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, self.path)  # Atomic: a crash here keeps the old file.

  def write(self, step: int, metrics: dict, prefix: str = "") -> None:
    """Records `metrics` (scalars: floats, ints, numpy/jax 0-d arrays) at `step`.

    prefix: prepended to every key, e.g. "train/" gives "train/loss".
    """
    values = {prefix + k: float(v) for k, v in metrics.items()}
    clash = [k for k in values if k in _RESERVED]
    if clash:
      raise ValueError(f"metric names {clash} are reserved")
    record = {"step": int(step), "time": time.time()}
    record.update({k: v if math.isfinite(v) else None
                   for k, v in values.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in values.items():
        self._tb.add_scalar(k, v, int(step), walltime=record["time"])

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
