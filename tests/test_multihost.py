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
import signal
import socket
import subprocess
import sys
import time

import pytest

from test_train_agent import TINY

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONFAULTHANDLER": "1", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
       + " --xla_force_host_platform_device_count=2"}
TIMEOUT_S = 600


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(make_argv, cwd, logdir):
  """Starts process 0 and 1 with `make_argv(process_id)`; their (rc, output).

  Output goes to files, not pipes: a process blocked on a full pipe nobody
  reads would hang the other in its next collective. Past the deadline both
  get SIGABRT, on which faulthandler prints every thread's stack: a hang's
  failure message says where each process waited.
  """
  logs = [logdir / f"process{i}.log" for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, "w") as f:
      procs.append(subprocess.Popen(make_argv(i), cwd=cwd, env=ENV, stdout=f,
                                    stderr=subprocess.STDOUT))
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for p in procs:
      p.wait(timeout=max(deadline - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGABRT)
    for p in procs:
      try:
        p.wait(timeout=60)
      except subprocess.TimeoutExpired:
        p.kill()
    pytest.fail(f"not done after {TIMEOUT_S} s:\n" + "\n".join(
        f"--- process {i} (rc {p.returncode}):\n{log.read_text()[-8000:]}"
        for i, (p, log) in enumerate(zip(procs, logs))))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def test_multihost_checks_in_two_processes(tmp_path):
  port = _free_port()
  results = _launch(lambda i: [sys.executable, "_multihost_worker.py", str(i), str(port)],
                    ROOT / "tests", tmp_path)
  for i, (rc, out) in enumerate(results):
    assert rc == 0 and "FAIL" not in out, f"process {i}:\n{out[-6000:]}"
    assert out.count("PASS") == 3, out[-3000:]


def test_train_agent_across_two_processes(tmp_path):
  """SFT and one GAE iteration; metrics combined over both processes."""
  port = _free_port()
  workdir = tmp_path / "run"
  results = _launch(lambda i: [
      sys.executable, "experiments/train_agent.py", f"--workdir={workdir}", *TINY,
      "--config.iterations=1", "--config.mesh.multihost=True",
      f"--config.mesh.coordinator=localhost:{port}", "--config.mesh.num_processes=2",
      f"--config.mesh.process_id={i}", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
      # GAE: the value forward runs on the global batch, each process reads its rows.
      "--config.rl.credit=gae"],
      ROOT, tmp_path)
  for i, (rc, out) in enumerate(results):
    assert rc == 0, f"process {i}:\n{out[-6000:]}"
  assert "after RL" in results[0][1] and "after RL" not in results[1][1]
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == [1] and math.isfinite(train_rows[0]["train/loss"])
  # Both processes' episodes: 2 tasks x 2 samples, one task per process.
  assert train_rows[0]["rollout/episodes"] == 4
  assert json.loads((workdir / "summary.json").read_text())["rl_success"] >= 0
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir())[-1] == "1"
