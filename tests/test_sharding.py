"""Partition rules, mesh construction, and multi-device parity.

Rules and specs are checked here on an AbstractMesh (no devices needed). The
multi-device checks (sharded RL step and sampler equal to one device, weight
sync, checkpoint restore onto another mesh) run in `_sharding_worker.py`, in
a subprocess with 8 simulated CPU devices, since the XLA flag must be set
before jax starts and slows single-device code.
"""

import os
import re
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, PartitionSpec as P
import optax
import pytest

from agentrl_jax import models, sharding, train

MESH = AbstractMesh((2, 2, 2), sharding.AXES)
ROWS = ("data", "fsdp")

# What each parameter of a layer and of the model ends up as on MESH.
EXPECTED = {
    "embed_tokens/embedding": P("tensor", "fsdp"),
    "lm_head/kernel": P("fsdp", "tensor"),
    "norm/weight": P(),
    "value_head/kernel": P(),
    "value_head/bias": P(),
    "layers/*/input_layernorm/weight": P(),
    "layers/*/post_attention_layernorm/weight": P(),
    "layers/*/pre_feedforward_layernorm/weight": P(),
    "layers/*/post_feedforward_layernorm/weight": P(),
    "layers/*/self_attn/q_norm/weight": P(),
    "layers/*/self_attn/k_norm/weight": P(),
    "layers/*/self_attn/q_proj/kernel": P("fsdp", "tensor"),
    "layers/*/self_attn/k_proj/kernel": P("fsdp", "tensor"),
    "layers/*/self_attn/v_proj/kernel": P("fsdp", "tensor"),
    "layers/*/self_attn/q_proj/bias": P("tensor"),
    "layers/*/self_attn/k_proj/bias": P("tensor"),
    "layers/*/self_attn/v_proj/bias": P("tensor"),
    "layers/*/self_attn/o_proj/kernel": P("tensor", "fsdp"),
    "layers/*/self_attn/o_proj/bias": P(),
    "layers/*/mlp/gate_proj/kernel": P("fsdp", "tensor"),
    "layers/*/mlp/up_proj/kernel": P("fsdp", "tensor"),
    "layers/*/mlp/down_proj/kernel": P("tensor", "fsdp"),
}


def _abstract_params(cfg):
  model = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0)))
  return nnx.state(model, nnx.Param)


def _specs(tree, mesh=MESH):
  """{path with layer index -> '*': spec} of a tree's shardings."""
  out = {}
  flat = jax.tree_util.tree_flatten_with_path(sharding.param_shardings(tree, mesh))[0]
  for path, s in flat:
    out.setdefault(re.sub(r"layers/\d+/", "layers/*/", sharding.path_str(path)),
                   set()).add(s.spec)
  return out


@pytest.mark.parametrize("arch", models.SUPPORTED_ARCHS)
def test_every_decoder_param_gets_its_intended_spec(arch):
  # Biases and heads switched on so that every parameter kind is present.
  cfg = models.tiny_config(arch, value_head=True, qkv_bias=True, o_bias=True)
  specs = _specs(_abstract_params(cfg))
  want = {k: v for k, v in EXPECTED.items()
          if not (k.startswith("lm_head") and cfg.tie_word_embeddings)
          and not (k.endswith(("q_norm/weight", "k_norm/weight")) and not cfg.qk_norm)
          and not ("feedforward_layernorm" in k and not cfg.gemma)}
  assert specs == {k: {v} for k, v in want.items()}


def test_indivisible_dims_fall_back_to_replication():
  mesh = AbstractMesh((1, 4, 2), sharding.AXES)
  # 6 rows do not split 4 ways (fsdp), 8 columns split 2 ways (tensor).
  assert sharding.fit_spec(P("fsdp", "tensor"), (6, 8), mesh) == P(None, "tensor")
  # Rows go over data x fsdp = 1 x 4.
  assert sharding.fit_spec(P(ROWS), (8, 3), mesh) == P(ROWS)
  assert sharding.fit_spec(P(ROWS), (6, 3), mesh) == P(None)
  # A model whose sizes no axis divides still shards: all replicated.
  cfg = models.tiny_config("llama", vocab_size=63, hidden_size=30, intermediate_size=42,
                           num_heads=3, num_kv_heads=1, head_dim=10)
  specs = _specs(_abstract_params(cfg), AbstractMesh((1, 4, 4), sharding.AXES))
  assert all(axis is None for spec_set in specs.values() for spec in spec_set
             for axis in spec)


def test_optimizer_state_follows_params_and_scalars_are_replicated():
  model = models.Decoder(models.tiny_config("qwen2", num_layers=1), rngs=nnx.Rngs(0))
  tx = train.make_optimizer(train.OptimConfig())
  state = jax.eval_shape(lambda: train.init_train_state(model, tx, with_reference=True)[1])
  shardings = sharding.param_shardings(state, MESH)
  params = shardings.params
  adam = shardings.opt_state[1][0]
  for tree in (adam.mu, adam.nu, shardings.ref_params):
    assert tree == params
  assert adam.count.spec == shardings.step.spec == P()


def test_unmatched_parameter_is_an_error():
  tree = {"adapter": {"kernel": jax.ShapeDtypeStruct((4, 4), jnp.float32)}}
  with pytest.raises(ValueError, match="no partition rule matches parameter 'adapter/kernel'"):
    sharding.param_shardings(tree, MESH)
  rules = sharding.PARTITION_RULES + ((r"adapter/kernel$", P("fsdp")),)
  assert sharding.param_shardings(tree, MESH, rules)["adapter"]["kernel"].spec == P("fsdp")


def test_cache_sharding_splits_slots_and_kv_heads_where_they_divide():
  cache = models.KVCache(k=(jax.ShapeDtypeStruct((4, 2, 16, 8), jnp.float32),),
                         v=(jax.ShapeDtypeStruct((3, 2, 16, 8), jnp.float32),))
  got = sharding.cache_sharding(cache, MESH)
  assert got.k[0].spec == P(ROWS, "tensor")
  assert got.v[0].spec == P(None, "tensor")
  one_kv_head = jax.ShapeDtypeStruct((4, 1, 16, 8), jnp.float32)
  assert sharding.cache_sharding(one_kv_head, MESH).spec == P(ROWS, None)


def test_make_mesh_names_auto_axes_and_checks_the_device_count():
  one = jax.devices()[:1]
  mesh = sharding.make_mesh(sharding.MeshConfig(), one)
  assert mesh.axis_names == sharding.AXES
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
  with pytest.raises(ValueError, match="= 8 devices, but 1 devices are given"):
    sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2), one)


@pytest.fixture(scope="module")
def worker_output():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"))
  worker = os.path.join(os.path.dirname(__file__), "_sharding_worker.py")
  proc = subprocess.run([sys.executable, worker], env=env, capture_output=True,
                        text=True, timeout=600)
  return proc.stdout + proc.stderr[-4000:]


@pytest.mark.parametrize("check", [
    "rl_step_matches_single_device",
    "lora_step_matches_single_device",
    "sampler_matches_single_device",
    "checkpoint_restores_onto_another_mesh",
    "async_rollouts_sample_on_their_own_devices",
])
def test_on_8_devices(worker_output, check):
  assert f"PASS {check}" in worker_output, worker_output
