"""Multi-host training with 2 CPU processes of 2 devices each (4 global devices).

jax.distributed joins the processes through a coordinator on a free local
port; `_multihost_worker.py` holds the checks (global batch assembly, the
sharded RL step equal to one process's, weight sync onto local samplers,
metric combination). The end-to-end test runs experiments/train_agent.py
with --config.mesh.multihost=True in both processes.
"""

import json
import math
import os
import pathlib
import socket
import subprocess
import sys

from test_train_agent import TINY

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
       + " --xla_force_host_platform_device_count=2"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(make_argv, cwd):
  """Starts process 0 and 1 with `make_argv(process_id)`; their (rc, output)."""
  procs = [subprocess.Popen(make_argv(i), cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [(p.returncode, out) for p, out in zip(procs, outs)]


def test_multihost_checks_in_two_processes():
  port = _free_port()
  results = _launch(lambda i: [sys.executable, "_multihost_worker.py", str(i), str(port)],
                    ROOT / "tests")
  for i, (rc, out) in enumerate(results):
    assert rc == 0 and "FAIL" not in out, f"process {i}:\n{out[-6000:]}"
    assert out.count("PASS") == 3, out[-3000:]


def test_train_agent_across_two_processes(tmp_path):
  """SFT and one GAE iteration; metrics combined over both processes."""
  port = _free_port()
  results = _launch(lambda i: [
      sys.executable, "experiments/train_agent.py", f"--workdir={tmp_path}", *TINY,
      "--config.iterations=1", "--config.mesh.multihost=True",
      f"--config.mesh.coordinator=localhost:{port}", "--config.mesh.num_processes=2",
      f"--config.mesh.process_id={i}", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
      # GAE: the value forward runs on the global batch, each process reads its rows.
      "--config.rl.credit=gae"],
      ROOT)
  for i, (rc, out) in enumerate(results):
    assert rc == 0, f"process {i}:\n{out[-6000:]}"
  assert "after RL" in results[0][1] and "after RL" not in results[1][1]
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == [1] and math.isfinite(train_rows[0]["train/loss"])
  # Both processes' episodes: 2 tasks x 2 samples, one task per process.
  assert train_rows[0]["rollout/episodes"] == 4
  assert json.loads((tmp_path / "summary.json").read_text())["rl_success"] >= 0
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "1"
