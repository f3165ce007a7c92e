"""The README's main command must keep working."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_core_runs_and_packed_equals_padded():
  out = subprocess.run(
      [sys.executable, str(ROOT / "experiments/demo_core.py"), "--num_tasks=2"],
      capture_output=True, text=True, timeout=300, check=True)
  assert "padded and packed losses agree." in out.stdout
  assert out.stdout.count("loss padded") == 3
