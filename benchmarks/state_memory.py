"""Per-device memory of the RL train state of Qwen2.5 0.5B, 1.5B and 7B,
and of 0.5B and 7B under LoRA.

  python benchmarks/state_memory.py

Shapes only: the models, the TrainState and the sampler's copy are traced
with `jax.eval_shape`, so no parameter is ever allocated (the 7B runs on a
laptop in seconds). Under the mixed-precision design a parameter costs 20
bytes in all: float32 masters (4), AdamW mu and nu in float32 (8), one
float32 gradient (4), the bf16 KL reference (2) and the sampler's bf16 copy
(2). Per device, each leaf counts its shard under `sharding.param_shardings`
on a `MeshConfig(fsdp=n)` mesh of n simulated CPU devices (fsdp=1 is the
total); biases and norms are replicated by rule, and a dimension that does
not divide n stays replicated (`fit_spec`), counted whole on every device.

Under LoRA (`models.lora`, rank 8 and 16 on every linear) only the
adapters have masters, moments, gradients and a reference; the frozen base
is one bf16 copy in the state (2 bytes a parameter) next to the sampler's
(2 more).

Not counted: activations (and what remat saves of them), the sampler's KV
cache, the rollout batch, XLA temporaries (FSDP's all-gathered layer
weights, the logits, optax's updates tree), and with `micro_batches` > 1 the
second gradient copy (the scan's accumulator next to one micro-batch's).

The last line is `<model>_params=N <model>_fsdp<n>_gib=x ...
<model>_lora<r>_trainable=N <model>_lora<r>_fsdp<n>_gib=x ...`.
"""

import functools
import os

# Simulated devices for the meshes; set before jax starts. Only shapes are
# computed, so the CPU backend is enough whatever accelerator is present.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from flax import nnx  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from agentrl_jax import models, sharding, train  # pylint: disable=wrong-import-position

GIB = 2**30
FSDP = (1, 4, 8)
PARTS = ("masters", "moments", "gradients", "frozen", "reference", "sampler")
HEADER = ("masters (f32)", "AdamW moments", "gradients", "frozen base (bf16)",
          "KL reference (bf16)", "sampler copy (bf16)")
LORA_MODELS = ("qwen2.5-0.5b", "qwen2.5-7b")
LORA_RANKS = (8, 16)


def _qwen25(hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied):
  """A Qwen2.5 config from its published config.json values."""
  return models.ModelConfig(
      arch="qwen2", vocab_size=vocab, hidden_size=hidden,
      intermediate_size=intermediate, num_layers=layers, num_heads=heads,
      num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=1e6,
      rms_norm_eps=1e-6, tie_word_embeddings=tied, qkv_bias=True,
      max_position_embeddings=32768, dtype=jnp.bfloat16, param_dtype=jnp.float32)


QWEN25 = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, 64, 151936, True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, 128, 151936, True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 128, 152064, False),
}


@functools.cache  # a 7B trace takes seconds; every mesh reuses it
def abstract_state(cfg, lora=None):
  """(TrainState, sampler params) of ShapeDtypeStructs, as `experiments/
  train_agent.py` builds them: `init_train_state` with a KL reference (with
  adapters when `lora`, a `models.LoraConfig`, is given), and
  `Sampler.update_params`'s `compute_params` copy."""
  tx = train.make_optimizer(train.OptimConfig())

  def build():
    model = models.Decoder(cfg, rngs=nnx.Rngs(0))
    if lora is not None:
      model = models.add_adapters(model, lora, nnx.Rngs(1))
    state = train.init_train_state(model, tx, with_reference=True)[1]
    return state, models.compute_params(state.model_params, cfg.dtype)

  return jax.eval_shape(build)


def _bytes(tree, mesh):
  """Bytes of one device's shards of `tree`'s leaves under the partition rules."""
  shards = jax.tree.leaves(sharding.param_shardings(tree, mesh))
  return sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
             for x, s in zip(jax.tree.leaves(tree), shards, strict=True))


def state_memory(cfg, fsdp, devices=None, lora=None):
  """Per-device bytes of each part of the RL state on a MeshConfig(fsdp=fsdp)
  mesh over the first `fsdp` devices: {part: bytes} for PARTS, plus "total",
  "params" (the model's parameter count) and "trainable" (those trained)."""
  devices = (jax.devices() if devices is None else devices)[:fsdp]
  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=fsdp), devices)
  state, sampler_params = abstract_state(cfg, lora)
  out = dict(
      masters=_bytes(state.params, mesh),
      moments=_bytes(state.opt_state, mesh),  # mu, nu (+ scalar counters)
      # Gradients have the params' shapes, dtype (float32) and sharding.
      gradients=_bytes(state.params, mesh),
      frozen=0 if state.frozen is None else _bytes(state.frozen, mesh),
      reference=_bytes(state.ref_params, mesh),
      # The sampler shards its copy by the same rules over its own mesh,
      # here the trainer's.
      sampler=_bytes(sampler_params, mesh))
  out["total"] = sum(out[k] for k in PARTS)
  out["trainable"] = sum(x.size for x in jax.tree.leaves(state.params))
  out["params"] = out["trainable"] + sum(x.size for x in jax.tree.leaves(state.frozen))
  return out


def replicated_leaves(cfg, fsdp):
  """Names of the parameters that `fit_spec` leaves whole on every device of a
  fsdp mesh (leaves the rules themselves replicate, norms and biases, aside)."""
  mesh = jax.sharding.AbstractMesh((1, fsdp, 1), sharding.AXES)
  flat = jax.tree_util.tree_flatten_with_path(abstract_state(cfg)[0].params)[0]
  return [sharding.path_str(p) for p, x in flat if x.ndim == 2 and "fsdp" not in
          sharding.partition_spec(sharding.path_str(p), x.shape, mesh)]


def _table(first, rows):
  print()
  print(f"| {first} | fsdp | {' | '.join(HEADER)} | total per device (GiB) |")
  print("|---|" + "---|" * first.count("|") + "---|" + "---|" * (len(HEADER) + 1))
  print("\n".join(rows))


def _cells(m) -> str:
  return " | ".join(f"{m[k] / GIB:.2f}" for k in PARTS) + f" | {m['total'] / GIB:.2f}"


def main():
  rows, pairs = [], []
  for name, cfg in QWEN25.items():
    for n in FSDP:
      m = state_memory(cfg, n)
      if n == FSDP[0]:
        pairs.append(f"{name}_params={m['params']}")
        print(f"{name}: {m['params'] / 1e9:.2f}B parameters, "
              f"{m['total'] / m['params']:.2f} bytes/parameter")
        print("  matrices fit_spec replicates: " + "; ".join(
            f"fsdp={k}: {', '.join(replicated_leaves(cfg, k)) or 'none'}"
            for k in FSDP[1:]))
      rows.append(f"| {name} | {m['params'] / 1e9:.2f}B | {n} | {_cells(m)} |")
      pairs.append(f"{name}_fsdp{n}_gib={m['total'] / GIB:.3f}")
  _table("model | parameters", rows)
  rows = []
  for name in LORA_MODELS:
    for rank in LORA_RANKS:
      lora = models.LoraConfig(rank=rank, alpha=2.0 * rank)
      for n in (FSDP[0], FSDP[-1]):
        m = state_memory(QWEN25[name], n, lora=lora)
        rows.append(f"| {name} | {rank} | {m['trainable'] / 1e6:.1f}M | {n} | {_cells(m)} |")
        pairs.append(f"{name}_lora{rank}_fsdp{n}_gib={m['total'] / GIB:.3f}")
      pairs.append(f"{name}_lora{rank}_trainable={m['trainable']}")
  _table("model | LoRA rank | trained parameters", rows)
  print()
  print(" ".join(pairs))


if __name__ == "__main__":
  main()
