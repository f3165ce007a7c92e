"""experiments/train_agent.py end to end at a tiny size: files, resume, determinism."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from agentrl_jax import checkpointing, viewer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import conftest  # pylint: disable=wrong-import-position
import view  # pylint: disable=wrong-import-position
import test_viewer  # pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [
    "--config=experiments/configs/default.py", "--config.sft.steps=4",
    "--config.sft.num_demos=8", "--config.sft.batch_size=4",
    "--config.env.num_train_tasks=40", "--config.env.num_eval_tasks=4",
    "--config.rl.tasks_per_iteration=2", "--config.rl.group_size=2",
    "--config.sampler.num_slots=4", "--config.eval_every=1",
    "--config.checkpoint_every=1", "--config.log.trajectories_every=1",
    "--config.log.eval_episodes=2",
]


def _command(workdir, iterations, *extra):
  return [sys.executable, "experiments/train_agent.py", f"--workdir={workdir}", *TINY,
          f"--config.iterations={iterations}", *extra]


def _run(workdir, iterations, *extra):
  out = subprocess.run(_command(workdir, iterations, *extra), cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _metrics(workdir):
  """Metric rows without timings, and without the sampled evaluation each run
  adds at its own last iteration (a run stopped at 2 of 3 measured there)."""
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in l.items()
           if k not in ("time", "eval/success_sampled") and not k.endswith("_s")
           and not k.startswith("eval/pass_at_")}
          for l in lines]


def test_train_agent_writes_outputs_and_resumes_identically(tmp_path):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  stdout = _run(straight, 3)
  assert "held-out success after SFT" in stdout and "after RL" in stdout
  for name in ("config.json", "metrics.jsonl", "curves.png", "summary.json"):
    assert (straight / name).stat().st_size > 0, name
  assert list((straight / "tb").iterdir()), "TensorBoard events written"
  assert sorted(p.name for p in (straight / "checkpoints").iterdir())[-1] == "3"
  # pass@4 of 4 samples a task holds a success among them: never below avg@4.
  summary = json.loads((straight / "summary.json").read_text())
  for phase in ("sft", "rl"):
    assert 0 <= summary[f"{phase}_success_sampled"] <= summary[f"{phase}_pass_at_4"] <= 1
  # The greedy gain, paired on the held-out tasks, is the change of success.
  assert summary["greedy_gain"] == pytest.approx(summary["rl_success"] - summary["sft_success"])
  assert summary["greedy_gain_se"] >= 0 and "paired SE" in stdout
  _run(resumed, 2)
  assert "resumed from" in _run(resumed, 3)
  # Same seed: the resumed run continues exactly where the straight one went.
  a, b = _metrics(straight), _metrics(resumed)
  assert [m["step"] for m in a] == [m["step"] for m in b]
  assert a == b
  # The viewer's episodes too: the resumed run dropped what it redid (group
  # ids are the engine's counter, which restarts with the process).
  episodes = [[{k: v for k, v in r.items() if k != "group_id"}
               for r in viewer.read_jsonl(d / "trajectories.jsonl")] for d in (straight, resumed)]
  assert [r["iteration"] for r in episodes[0]][-3:] == [3, 3, 3]
  assert episodes[0] == episodes[1]
  summaries = [json.loads((d / "summary.json").read_text()) for d in (straight, resumed)]
  assert summaries[0] == summaries[1]


def test_a_lora_run_trains_its_adapters_and_resumes_from_them(tmp_path):
  lora = ("--config.model.lora.rank=8", "--config.loss.kl_beta=0.01")
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  _run(straight, 2, *lora)
  _run(resumed, 1, *lora)
  assert "resumed from" in _run(resumed, 2, *lora)
  assert _metrics(straight) == _metrics(resumed)  # the base rebuilt from the seed
  # The KL term runs against the adapters' start (its value: no update has
  # signal at this size, so it stays 0).
  assert sum("train/kl_k3_grad_forward" in m for m in _metrics(straight)) == 2
  # The checkpoint holds the adapters (A and B) and their moments, never the
  # base; training moved every B off its zero start (SFT does on this task).
  with checkpointing.Checkpointer(straight / "checkpoints") as ckpt:
    state, _ = ckpt.restore(2, abstract_state=None)
  assert state.get("frozen") is None
  params = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}
  assert len(params) == 2 * 7 * 2 and all("lora" in p for p in params)  # 2 layers x 7
  assert all(np.abs(x).min() > 0 for p, x in params.items() if "lora_b" in p)


def test_sft_checks_its_policy_on_tasks_without_demos(tmp_path):
  # A level never reached: SFT runs its 4 steps, checking after the 2nd and 4th.
  _run(tmp_path, 0, "--config.sft.stop_at_success=1.0", "--config.sft.check_every=2")
  checks = [(m["step"], m["sft/check_success"]) for m in _metrics(tmp_path)
            if "sft/check_success" in m]
  assert [step for step, _ in checks] == [-3, -1]  # SFT step i at i - 4
  assert all(0 <= success < 1 for _, success in checks)
  assert json.loads((tmp_path / "summary.json").read_text())["sft_steps"] == 4


def test_a_kl_run_resumes_a_checkpoint_saved_without_a_reference(tmp_path):
  kl = "--config.loss.kl_beta=0.1"
  _run(tmp_path, 0)  # SFT alone: RL iteration 0's checkpoint holds no reference
  _run(tmp_path, 1, kl)
  # The reference is the policy RL started from: before the first update
  # (the logged epoch) the policy is still it, so the KL is 0.
  (first,) = [m for m in _metrics(tmp_path) if m["step"] == 1]
  assert first["train/kl_k3_grad_forward"] == 0.0
  _run(tmp_path, 2)  # saved with a reference, resumed without one
  # Past iteration 0 the start policy is gone: a clear error, not a corrupt one.
  out = subprocess.run(_command(tmp_path, 3, kl), cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode != 0
  assert "holds no KL reference" in out.stderr and "CorruptCheckpoint" not in out.stderr


def test_a_real_run_writes_episodes_the_viewer_shows(tmp_path):
  workdir = tmp_path / "run"
  _run(workdir, 2)
  records = viewer.read_jsonl(workdir / "trajectories.jsonl")
  train = [r for r in records if r["phase"] == "train"]
  evals = [r for r in records if r["phase"] == "eval"]
  # 2 groups x 2 episodes (best and worst) per iteration; 2 held-out
  # episodes at the SFT evaluation and after each iteration (eval_every=1).
  assert [r["iteration"] for r in train] == [1] * 4 + [2] * 4
  assert [r["iteration"] for r in evals] == [0, 0, 1, 1, 2, 2]
  for r in train:
    on = np.asarray(r["loss_mask"]) > 0
    assert on.any() and all(r["advantage"][i] is not None for i in np.flatnonzero(on))
    # The sampler ran the parameters the trainer read before its update:
    # on every action token the two log-probs agree.
    sampler = np.asarray([r["sampler_logprob"][i] for i in np.flatnonzero(on)])
    trainer = np.asarray([r["trainer_logprob"][i] for i in np.flatnonzero(on)])
    np.testing.assert_allclose(trainer, sampler, atol=2e-4)
  page = view.write_page(workdir)
  test_viewer.check_page(records, page.read_text())
  conftest.require_browser()
  run = view.browse(page)
  assert 'data-ready="1"' in run.stdout and "data-error" not in run.stdout
  main = run.stdout[run.stdout.index("<main>"):]
  assert main.count('<section class="episode"') == len(records)


def test_an_async_run_killed_mid_iteration_resumes(tmp_path):
  """kill -9 while iteration 3's update and iteration 4's rollouts are in
  flight: the rerun resumes from checkpoint 2 and logs every iteration once."""
  asynchronous = ("--config.rl.max_staleness=1", "--config.loss.is_correction=tis")
  proc = subprocess.Popen(_command(tmp_path, 6, *asynchronous), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / "checkpoints" / "2").is_dir():
      assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint 2"
      time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the kill"
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  out = _run(tmp_path, 6, *asynchronous)
  assert "resumed from" in out and "step 2" in out, out
  steps = [m["step"] for m in _metrics(tmp_path) if m["step"] > 0]
  assert steps == [1, 2, 3, 4, 5, 6], steps
  stale = [m["rollout/staleness_max"] for m in _metrics(tmp_path) if m["step"] > 0]
  # The resumed run restarts the pipeline: its first iteration is on-policy.
  assert stale == [0, 1, 0, 1, 1, 1], stale
