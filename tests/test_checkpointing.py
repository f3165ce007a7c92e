"""Checkpointer: bit-exact round trips, keep-last-k, step selection, extra."""

import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentrl_jax.checkpointing import Checkpointer, CorruptCheckpointError


def _bits(x):
  """A leaf as raw bytes plus dtype, so equality is bitwise (NaN == NaN)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return str(x.dtype), jax.random.key_data(x).tobytes()
  x = np.asarray(x)
  return str(x.dtype), x.shape, x.tobytes()


def _assert_bit_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert type(x) is type(y) or isinstance(y, jax.Array)
    assert _bits(x) == _bits(y)


def _round_trip(tmp_path, state, extra=None):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(7, state, extra)
    return ckpt.restore(abstract_state=jax.eval_shape(lambda: state))


def test_arrays_of_several_dtypes_bit_exact(tmp_path):
  k1, k2 = jax.random.split(jax.random.key(0))
  state = {
      "f32": jax.random.normal(k1, (5, 3)).at[0, 0].set(jnp.nan),
      "bf16": jax.random.normal(k2, (4,), jnp.bfloat16),
      "i32": jnp.arange(6, dtype=jnp.int32).reshape(2, 3),
      "scalar": jnp.float32(-0.0),
  }
  restored, extra = _round_trip(tmp_path, state)
  _assert_bit_equal(state, restored)
  assert extra == {}


def test_prng_keys_restore_as_typed_keys(tmp_path):
  state = {"key": jax.random.key(42), "rbg": jax.random.key(1, impl="rbg"),
           "keys": jax.random.split(jax.random.key(3), 4)}
  restored, _ = _round_trip(tmp_path, state)
  _assert_bit_equal(state, restored)
  assert jax.random.key_impl(restored["rbg"]) == jax.random.key_impl(
      state["rbg"])
  # The restored key draws the same numbers as the original.
  np.testing.assert_array_equal(jax.random.uniform(restored["key"], (3,)),
                                jax.random.uniform(state["key"], (3,)))


def test_nnx_model_optimizer_and_rngs_bit_exact(tmp_path):
  model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  rngs = nnx.Rngs(params=1, dropout=2)
  rngs.dropout()  # advance a counter so it is not the initial value
  tx = optax.adamw(1e-2)
  opt_state = tx.init(nnx.state(model, nnx.Param))
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  _, opt_state = tx.update(grads, opt_state, nnx.state(model, nnx.Param))
  state = {"model": nnx.state(model), "opt": opt_state,
           "rngs": nnx.state(rngs)}

  restored, _ = _round_trip(tmp_path, state)
  _assert_bit_equal(state, restored)

  # Restored state drives a fresh model to the same outputs.
  fresh = nnx.Linear(3, 4, rngs=nnx.Rngs(99))
  nnx.update(fresh, restored["model"])
  x = jnp.ones((2, 3))
  np.testing.assert_array_equal(fresh(x), model(x))


def test_restore_into_concrete_arrays(tmp_path):
  state = {"w": jnp.arange(4.0, dtype=jnp.bfloat16)}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, state)
    restored, _ = ckpt.restore(abstract_state=jax.tree.map(jnp.zeros_like,
                                                           state))
  _assert_bit_equal(state, restored)


def test_keep_last_k_latest_and_specific_step(tmp_path):
  def state(step):
    return {"x": jnp.full((2,), step, jnp.int32)}
  abstract = jax.eval_shape(lambda: state(0))
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError):
      ckpt.restore(abstract_state=abstract)
    for step in (10, 20, 30):
      ckpt.save(step, state(step), {"data_position": step * 4})
    ckpt.wait()
    assert ckpt.latest_step() == 30
    assert ckpt.all_steps() == [20, 30]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20", "30"]
    restored, extra = ckpt.restore(20, abstract_state=abstract)
    assert int(restored["x"][0]) == 20 and extra == {"data_position": 80}

  # A new Checkpointer on the same directory (a resumed run) finds them.
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() == 30
    restored, extra = ckpt.restore(abstract_state=abstract)
    assert int(restored["x"][0]) == 30 and extra == {"data_position": 120}


def test_extra_json_round_trip(tmp_path):
  extra = {"step": 5, "config": {"lr": 1e-3, "name": "grpo", "turns": [1, 2]},
           "loader": {"epoch": 1, "index": 17}, "done": False, "none": None}
  _, restored = _round_trip(tmp_path, {"x": jnp.zeros(1)}, extra)
  assert restored == extra


@pytest.mark.parametrize("damaged", ["extra/metadata", "state/_METADATA"])
def test_a_truncated_checkpoint_is_named_and_the_last_intact_one_taken(tmp_path, damaged):
  def state(step):
    return {"x": jnp.full((2,), step, jnp.int32)}
  abstract = jax.eval_shape(lambda: state(0))
  with Checkpointer(tmp_path) as ckpt:
    for step in (10, 20, 30):
      ckpt.save(step, state(step), {"step": step})
  for step in (30, 20):  # a crash mid-write: the file's first half only
    path = tmp_path / str(step) / damaged
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CorruptCheckpointError, match=re.escape(
        f"checkpoint {tmp_path / '30'} cannot be read (JSONDecodeError: ")) as e:
      ckpt.restore(abstract_state=abstract)
    assert "other steps on disk: [10, 20]" in str(e.value)
    with pytest.warns(RuntimeWarning) as warned:
      step, restored, extra = ckpt.restore_latest(abstract_state=abstract)
    assert (step, int(restored["x"][0]), extra) == (10, 10, {"step": 10})
    assert [str(tmp_path / s) in str(w.message) for w, s in zip(warned, ("30", "20"))] == [
        True, True]
    (tmp_path / "10" / damaged).write_text("{")
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(tmp_path / "10"))):
      ckpt.restore_latest(abstract_state=abstract)


def _peak_gib_above_start(fn) -> float:
  """GiB the process's peak resident memory rose by while `fn` ran (the
  kernel's VmHWM, reset first through /proc/self/clear_refs)."""
  def status(key):
    with open("/proc/self/status") as f:
      return next(int(l.split()[1]) for l in f if l.startswith(key)) / 2**20
  start = status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  fn()
  return status("VmHWM") - start


def test_write_gb_bounds_the_memory_a_save_takes(tmp_path):
  # 0.5 GiB of random float32 in 16 arrays of 32 MiB: unbounded, the write's
  # encoded chunks took 0.40-0.47 GiB more here; at 0.05 GB in flight (one
  # array) 0.06-0.12.
  state = {f"w{i}": jax.random.normal(jax.random.key(i), (8, 1024, 1024)) for i in range(16)}
  jax.block_until_ready(state)

  def save():
    with Checkpointer(tmp_path / "bounded", write_gb=0.05) as ckpt:
      ckpt.save(1, state)

  assert _peak_gib_above_start(save) < 0.25
  with Checkpointer(tmp_path / "bounded") as ckpt:
    restored, _ = ckpt.restore(abstract_state=jax.eval_shape(lambda: state))
  _assert_bit_equal(state, restored)


def test_write_gb_below_an_array_is_refused_before_writing(tmp_path):
  state = {"small": jnp.zeros((10,)), "big": jnp.zeros((1000, 100))}  # 400 kB
  with Checkpointer(tmp_path, write_gb=0.0003) as ckpt:
    with pytest.raises(ValueError, match=r"0\.0004 GB, more than the checkpoint's write_gb = 0\.0003"):
      ckpt.save(1, state)
    assert ckpt.all_steps() == []
  with pytest.raises(ValueError, match="write_gb must be > 0"):
    Checkpointer(tmp_path, write_gb=0)
