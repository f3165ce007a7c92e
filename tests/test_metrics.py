"""MetricsWriter / read_metrics, and the plot_curves script that reads them."""

import glob
import math
import os
import pathlib
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from agentrl_jax.metrics import MetricsWriter, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tb_events(path):
  """The events of one TensorBoard file, read as TFRecords."""
  data, pos, events = open(path, "rb").read(), 0, []
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
    pos += 12 + length + 4  # length, its crc, payload, payload crc
  return events


def _tb_scalars(workdir):
  """(tag, step, value) of every scalar in workdir/tb."""
  return [(v.tag, e.step, v.simple_value)
          for path in glob.glob(os.path.join(workdir, "tb", "events.*"))
          for e in _tb_events(path) for v in e.summary.value]


def _strip_time(records):
  return [{k: v for k, v in r.items() if k != "time"} for r in records]


def test_write_reads_back_and_reaches_tensorboard(tmp_path):
  with MetricsWriter(tmp_path) as w:
    w.write(0, {"loss": 1.5, "n": 3}, prefix="train/")
    w.write(1, {"loss": np.float32(0.25), "acc": jnp.asarray(0.5)},
            prefix="train/")
    w.write(1, {"success": 1.0}, prefix="eval/")
  records = read_metrics(tmp_path)
  assert _strip_time(records) == [
      {"step": 0, "train/loss": 1.5, "train/n": 3.0},
      {"step": 1, "train/loss": 0.25, "train/acc": 0.5},
      {"step": 1, "eval/success": 1.0}]
  assert all(isinstance(r["time"], float) for r in records)
  assert sorted(_tb_scalars(tmp_path)) == sorted([
      ("train/loss", 0, 1.5), ("train/n", 0, 3.0), ("train/loss", 1, 0.25),
      ("train/acc", 1, 0.5), ("eval/success", 1, 1.0)])


def test_non_finite_written_as_null_read_as_nan(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as w:
    w.write(0, {"a": float("nan"), "b": float("inf"), "c": -np.inf, "d": 2.0})
  assert open(tmp_path / "metrics.jsonl").read().count("null") == 3
  (r,) = read_metrics(tmp_path)
  assert all(math.isnan(r[k]) for k in "abc") and r["d"] == 2.0
  assert not os.path.exists(tmp_path / "tb")


def test_reserved_and_non_scalar_values_rejected(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as w:
    with pytest.raises(ValueError, match="reserved"):
      w.write(0, {"step": 1.0})
    with pytest.raises(TypeError):
      w.write(0, {"v": np.ones(2)})


def test_truncated_last_line_is_tolerated_and_repaired(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as w:
    w.write(0, {"x": 1.0})
    w.write(1, {"x": 2.0})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 2, "x"')  # the crash hit mid-line
  assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
  with MetricsWriter(tmp_path, tensorboard=False) as w:  # plain reopen appends
    w.write(2, {"x": 3.0})
  assert [r["x"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]


def test_corrupt_middle_line_raises(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"st\n{"step": 1}\n')
  with pytest.raises(ValueError, match="not JSON"):
    read_metrics(tmp_path)


def test_resume_step_drops_later_steps(tmp_path):
  with MetricsWriter(tmp_path) as w:
    for step in range(5):
      w.write(step, {"x": float(step)})
  # The run crashed after step 4 but its last checkpoint is step 2.
  with MetricsWriter(tmp_path, resume_step=2) as w:
    for step in range(3, 5):
      w.write(step, {"x": 10.0 * step})
  assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [
      (0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
  # TensorBoard keeps both files; the new one opens with a purge marker at
  # step 3, so TensorBoard hides the old file's values from step 3 on.
  paths = glob.glob(str(tmp_path / "tb" / "events.*"))
  assert len(paths) == 2
  starts = [(e.step, e.session_log.status) for p in paths
            for e in _tb_events(p) if e.HasField("session_log")]
  assert starts == [(3, event_pb2.SessionLog.START)]


def _load_plot_curves():
  # One module object for every test: its absl flags can only be defined once.
  if str(ROOT / "experiments") not in sys.path:
    sys.path.insert(0, str(ROOT / "experiments"))
  import plot_curves  # pylint: disable=import-outside-toplevel
  return plot_curves


def test_plot_writes_png_and_skips_missing_keys(tmp_path):
  runs = {
      "a": [[{"step": s, "time": 100.0 + s, "train/loss": 1.0 / (s + 1),
              "eval/success": s / 10} for s in range(10)]],
      "b": [[{"step": s, "time": 50.0 + 2 * s, "train/loss": math.nan} for s in range(10)]],
  }
  out = tmp_path / "curves.png"
  _load_plot_curves().plot(runs, [("success", ("eval/success",)), ("loss", ("train/loss",)),
                                  ("absent", ("absent",))], str(out), x="time")
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert out.stat().st_size > 1000
  with pytest.raises(ValueError, match="none of the requested metrics"):
    _load_plot_curves().plot(runs, [("absent", ("absent",))], str(out))


def test_seeds_of_a_run_are_averaged_over_the_steps_they_share(tmp_path):
  plot_curves = _load_plot_curves()
  for run, seeds in (("grpo", 3), ("gae", 1)):
    for k in range(seeds):
      with MetricsWriter(tmp_path / run / f"seed{k}", tensorboard=False) as w:
        for step in range(4 - (k == 2)):  # seed 2 stopped a step early
          w.write(step, {"reward_mean": step + k}, prefix="rollout/")
  runs = plot_curves.group_seeds([str(tmp_path / "grpo" / f"seed{k}") for k in range(3)]
                                 + [str(tmp_path / "gae" / "seed0")])
  assert list(runs) == ["grpo", "gae"] and [len(v) for v in runs.values()] == [3, 1]
  xs, mean, low, high = plot_curves._series(runs["grpo"], "rollout/reward_mean", "step")  # pylint: disable=protected-access
  np.testing.assert_array_equal(xs, [0, 1, 2])
  np.testing.assert_allclose(mean, [1, 2, 3])
  np.testing.assert_array_equal(low, [0, 1, 2])
  np.testing.assert_array_equal(high, [2, 3, 4])
  out = tmp_path / "report.png"
  plot_curves.report(runs, str(out))
  # The report's panels name the keys a failing run is read by.
  keys = {k for _, ks in plot_curves.report_panels(runs) for k in ks}
  assert {"rollout/success_frac", "rollout/malformed_turn_frac", "train/grad_norm"} <= keys
  assert out.stat().st_size > 1000
  # Two workdirs of one basename that are not seeds stay apart, by path.
  dirs = [str(tmp_path / d / "run") for d in ("x", "y")]
  for d in dirs:
    with MetricsWriter(d, tensorboard=False) as w:
      w.write(0, {"reward_mean": 1.0}, prefix="rollout/")
  assert list(plot_curves.group_seeds(dirs)) == dirs


def test_plot_curves_cli(tmp_path):
  for name in ("a", "b"):
    with MetricsWriter(tmp_path / name, tensorboard=False) as w:
      for step in range(3):
        w.write(step, {"reward_mean": step * 0.5, "custom": 1.0}, prefix="rollout/")
  for keys in ([], ["--keys=all"]):  # the run report; every key
    out = tmp_path / f"curves{len(keys)}.png"
    subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "plot_curves.py"),
         f"--workdirs={tmp_path / 'a'},{tmp_path / 'b'}", f"--out={out}", *keys],
        check=True, capture_output=True, timeout=120)
    assert out.stat().st_size > 1000
  typo = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "plot_curves.py"), f"--workdirs={tmp_path / 'a'}",
       f"--out={tmp_path / 'typo.png'}", "--keys=rollout/reward_mean,rollout/reward_maen"],
      capture_output=True, text=True, timeout=120)
  assert typo.returncode != 0 and not (tmp_path / "typo.png").exists()
  assert "no run logged ['rollout/reward_maen']" in typo.stderr
