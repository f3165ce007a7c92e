"""train.memory: the train step's estimate, the micro-batching that fits, and a
run that would not fit stopping before any work."""

import pathlib
import subprocess
import sys

from flax import nnx
import jax
import optax
import pytest

from agentrl_jax import models, train
from agentrl_jax.train import memory

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup():
  model = models.Decoder(models.tiny_config("qwen2", vocab_size=512), rngs=nnx.Rngs(0))
  tx = optax.adamw(1e-3)
  graphdef, state = train.init_train_state(model, tx, with_reference=False)
  return graphdef, state, tx


def _rl(graphdef, tx):
  return lambda n: train.RLStep(graphdef, tx, train.LossConfig(micro_batches=n))


def test_the_state_is_counted_by_hand(setup):
  graphdef, state, _ = setup
  params = sum(x.size for x in jax.tree.leaves(nnx.split(
      models.Decoder(models.tiny_config("qwen2", vocab_size=512), rngs=nnx.Rngs(0)),
      nnx.Param)[1]))
  # float32 masters and AdamW's two moments; the counters are a few scalars.
  want = 3 * params * 4 / memory.GIB
  assert want <= memory.tree_gib(state) < want + 64 / memory.GIB


def test_micro_batches_and_rows_move_the_steps_temporaries(setup):
  graphdef, state, tx = setup
  rl = {n: memory.step_memory(_rl(graphdef, tx)(n), state, rows=8, length=256).temp_gib
        for n in (1, 2, 4)}
  assert rl[1] > 1.5 * rl[2] > 1.5 * 1.5 * rl[4] > 0, rl
  more_rows = memory.step_memory(_rl(graphdef, tx)(1), state, rows=16, length=256).temp_gib
  assert more_rows > 1.5 * rl[1]
  sft = {n: memory.step_memory(train.SFTStep(graphdef, tx, micro_batches=n), state, rows=8,
                               length=256).temp_gib for n in (1, 4)}
  assert sft[1] > 2 * sft[4] > 0, sft


def test_the_fewest_micro_batches_that_fit_are_picked(setup):
  graphdef, state, tx = setup
  make = _rl(graphdef, tx)
  est = {n: memory.step_memory(make(n), state, rows=8, length=256, other_gib=0.5)
         for n in (1, 2, 4, 8)}
  budget = (est[2].total_gib + est[1].total_gib) / 2
  got = memory.fit_micro_batches(make, state, rows=8, length=256, budget_gib=budget,
                                 micro_batches=1, other_gib=0.5)
  assert got == est[2]
  # Packed rows come in multiples of 4: 8 micro-batches could not split them.
  with pytest.raises(memory.MemoryBudgetError) as e:
    memory.fit_micro_batches(make, state, rows=8, length=256, multiple_of=4,
                             budget_gib=est[8].total_gib, micro_batches=1, other_gib=0.5)
  for n in (1, 2, 4):
    assert est[n].describe() in str(e.value)
  assert "micro_batches=8" not in str(e.value)
  assert memory.fit_micro_batches(make, state, rows=8, length=256, budget_gib=1e9,
                                  micro_batches=4).micro_batches == 4


def test_a_run_over_its_budget_stops_before_any_work(tmp_path):
  out = subprocess.run(
      [sys.executable, "experiments/train_agent.py", f"--workdir={tmp_path}",
       "--config=experiments/configs/default.py", "--config.memory_gb=0.01"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode != 0
  assert "SFT's step needs more than its memory budget of 0.01 GiB" in out.stderr
  assert "micro_batches=16" in out.stderr  # every split of the 16 rows was tried
  # Nothing ran: no demos, no step, no checkpoint, no metrics.
  assert "SFT:" not in out.stderr and not (tmp_path / "checkpoints").exists()
  assert not (tmp_path / "metrics.jsonl").exists()
