"""Arms of one experiment from a shared SFT start, all in this process."""

import pathlib
import shutil
import sys
import tempfile
from typing import Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import train_agent  # pylint: disable=wrong-import-position


def run_arms(arms: Sequence, config: Callable[[int, object], object], iterations: int,
             measure: Callable[[pathlib.Path], dict]) -> dict:
  """Runs SFT once (`config(0, arms[0])`: no RL iteration), then each arm's
  `config(iterations, arm)` from its checkpoint; returns {arm: measure(workdir)}."""
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    train_agent.run(config(0, arms[0]), tmp / "sft")  # SFT, evaluation, checkpoint 0
    for i, arm in enumerate(arms):
      workdir = tmp / f"arm_{i}"
      shutil.copytree(tmp / "sft" / "checkpoints" / "0", workdir / "checkpoints" / "0")
      train_agent.run(config(iterations, arm), workdir)
      results[arm] = measure(workdir)
  return results
