"""experiments/train_agent.py end to end at a tiny size: files, resume, determinism."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [
    "--config=experiments/configs/default.py", "--config.sft.steps=4",
    "--config.sft.num_demos=8", "--config.sft.batch_size=4",
    "--config.env.num_train_tasks=40", "--config.env.num_eval_tasks=4",
    "--config.rl.tasks_per_iteration=2", "--config.rl.group_size=2",
    "--config.sampler.num_slots=4", "--config.eval_every=1",
    "--config.checkpoint_every=1",
]


def _run(workdir, iterations):
  out = subprocess.run(
      [sys.executable, "experiments/train_agent.py", f"--workdir={workdir}", *TINY,
       f"--config.iterations={iterations}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _metrics(workdir):
  """Metric rows without timings, and without the sampled evaluation each run
  adds at its own last iteration (a run stopped at 2 of 3 measured there)."""
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in l.items()
           if k not in ("time", "eval/success_sampled") and not k.endswith("_s")}
          for l in lines]


def test_train_agent_writes_outputs_and_resumes_identically(tmp_path):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  stdout = _run(straight, 3)
  assert "held-out success after SFT" in stdout and "after RL" in stdout
  for name in ("config.json", "metrics.jsonl", "curves.png", "summary.json"):
    assert (straight / name).stat().st_size > 0, name
  assert list((straight / "tb").iterdir()), "TensorBoard events written"
  assert sorted(p.name for p in (straight / "checkpoints").iterdir())[-1] == "3"
  _run(resumed, 2)
  assert "resumed from" in _run(resumed, 3)
  # Same seed: the resumed run continues exactly where the straight one went.
  a, b = _metrics(straight), _metrics(resumed)
  assert [m["step"] for m in a] == [m["step"] for m in b]
  assert a == b
  summaries = [json.loads((d / "summary.json").read_text()) for d in (straight, resumed)]
  assert summaries[0] == summaries[1]
