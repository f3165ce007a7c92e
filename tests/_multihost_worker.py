"""One of the 2 processes of test_multihost.py: `_multihost_worker.py ID PORT`.

The parent sets XLA_FLAGS=--xla_force_host_platform_device_count=2, so the
two processes hold 4 CPU devices between them. Each check prints `PASS
<name>` or `FAIL <name>` and a traceback; the exit code is the number of
failures. Every check runs collectives, so both processes run all of them in
the same order.
"""

import sys

from agentrl_jax import distributed

distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2,
                       process_id=int(sys.argv[1]))

from flax import nnx  # pylint: disable=wrong-import-position
import jax
from jax.experimental import multihost_utils
import numpy as np
import optax

from agentrl_jax import models, sharding, train
from agentrl_jax.sampling import Sampler
from _worker_checks import check, run_checks  # this script's directory leads sys.path
from test_train_step import _batch

# fsdp across the processes, tensor across each one's two devices.
MESH_CFG = sharding.MeshConfig(data=1, fsdp=2, tensor=2)


def _full(x):
  """The whole value of a global array, on every process."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _local_half(batch):
  """This process's rows of an 8-row batch, seq ids renumbered from 0."""
  p, rows = jax.process_index(), batch.tokens.shape[0] // 2
  local = jax.tree.map(lambda x: x[p * rows:(p + 1) * rows], batch)
  return local.replace(seq_ids=np.where(local.seq_ids >= 0, local.seq_ids - p * rows, -1))


@check
def global_batch_is_the_concatenation_with_offset_seq_ids():
  mesh = sharding.make_mesh(MESH_CFG)
  full = _batch(0)  # 8 rows, trajectory i in row i with seq id i
  got = distributed.global_batch(_local_half(full), sharding.batch_sharding(mesh))
  # Process p's ids (0..3 each) move up by p x its 4 rows x L: below the
  # step's B x L bound even when packed rows hold more sequences than rows.
  rows, length = full.tokens.shape[0] // 2, full.tokens.shape[1]
  owner = np.arange(full.tokens.shape[0])[:, None] // rows
  ids = np.where(full.seq_ids >= 0, full.seq_ids + owner * rows * (length - 1), -1)
  for name, want in vars(full.replace(seq_ids=ids)).items():
    np.testing.assert_array_equal(_full(getattr(got, name)), want, err_msg=name)
  # Each process's rows sit on its own devices.
  for shard in got.tokens.addressable_shards:
    start = shard.index[0].start or 0
    assert start // 4 == jax.process_index(), shard.index


def _model():
  return models.Decoder(models.tiny_config("llama", vocab_size=64), rngs=nnx.Rngs(0))


@check
def rl_step_matches_one_process_and_syncs_to_local_samplers():
  model = _model()
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
  # Per-sequence aggregation: colliding seq ids across processes would
  # change the loss.
  cfg = train.LossConfig(agg="seq-mean-token-mean", kl_beta=0.05, entropy_coef=0.01,
                         micro_batches=2)
  full = _batch(0)
  graphdef, state = train.init_train_state(model, tx, with_reference=True)
  want_state, want = train.RLStep(graphdef, tx, cfg)(state, full)

  mesh = sharding.make_mesh(MESH_CFG)
  graphdef, state = train.init_train_state(model, tx, with_reference=True)
  step = train.RLStep(graphdef, tx, cfg, mesh=mesh)
  batch = distributed.global_batch(_local_half(full), sharding.batch_sharding(mesh))
  state, got = step(state, batch)
  np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(want_state.params), jax.tree.leaves(state.params),
                  strict=True):
    np.testing.assert_allclose(_full(b), np.asarray(a), rtol=1e-5, atol=1e-6)

  # Weight sync onto each process's own sampler mesh: exact, device to device.
  local = distributed.local_mesh(MESH_CFG)
  assert set(local.devices.flat) == set(jax.local_devices())
  sampler = Sampler(model, num_slots=2, cache_length=32, max_decode_length=4,
                    length_buckets=(8,), mesh=local)
  with jax.transfer_guard_device_to_host("disallow"), \
       jax.transfer_guard_host_to_device("disallow"):
    sampler.update_params(state.params)
  expected = jax.tree.leaves(sharding.param_shardings(sampler.params, local))
  for s, g, want_sharding in zip(jax.tree.leaves(sampler.params),
                                 jax.tree.leaves(state.params), expected, strict=True):
    assert s.is_fully_addressable and s.sharding == want_sharding, s.sharding
    np.testing.assert_array_equal(np.asarray(s), _full(g))
  # The trainer may donate its params: the sampler holds its own copy.
  state, _ = step(state, batch)
  s_state = sampler.prefill(sampler.init_state(), [0, 1], [[1, 2, 3], [4, 5]])
  _, actions = sampler.decode(s_state, [0, 1], max_new_tokens=4, temperature=0.0)
  assert all(len(a.tokens) == 4 for a in actions.values()), actions


@check
def combine_weights_means_and_adds_sums():
  p = jax.process_index()
  # Process 0: 1 episode, success 1.0; process 1: 3 episodes, success 0.0.
  got = distributed.combine({"success": 1.0 - p, "episodes": 1.0 + 2 * p, "t_max": p},
                            1 + 2 * p, sums=("episodes",), maxima=("t_max",))
  assert got == {"success": 0.25, "episodes": 4.0, "t_max": 1.0}, got
  assert distributed.agree_max([p, 5 - p]).tolist() == [1, 5]
  assert distributed.task_share(list(range(5))) == [[0, 2, 4], [1, 3]][p]


def main():
  assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
  run_checks()


if __name__ == "__main__":
  main()
