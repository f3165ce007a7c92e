"""How arrays map to devices: a (data, fsdp, tensor) mesh and partition rules.

Axes of the mesh:
- "data": batch rows (and sampler slots); parameters are replicated over it.
- "fsdp": batch rows too, and every parameter (so its gradient and optimizer
  moments) is split over it along its hidden dimension (ZeRO-3 style: XLA
  all-gathers a layer's weights where they are used).
- "tensor": attention heads and the MLP hidden dimension (Megatron-style
  column/row split), the vocabulary of the embedding and the LM head.

Shardings are fixed at the jit boundary (`in_shardings`/`out_shardings` of
the train step and the sampler) and XLA's partitioner places everything in
between, which is why the mesh axes are `AxisType.Auto` (jax 0.10 makes
Explicit axes by default).

A parameter is named by its '/'-joined path, e.g.
`layers/0/self_attn/q_proj/kernel`, or `opt_state/1/0/mu/layers/0/...` for
its Adam moment inside a TrainState; `PARTITION_RULES` maps it by the first
regex that `re.search`es the path. A dimension that does not divide by the
size of its mesh axes is replicated instead (`fit_spec`), so a tiny test
model still shards on any mesh; scalars (step counters, PRNG keys) are
replicated; any other leaf that no rule matches is an error.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
ROWS = ("data", "fsdp")  # batch rows and sampler slots are split over both

# Kernels are [in, out] (nnx.Linear); the embedding is [V, d].
PARTITION_RULES: tuple[tuple[str, P], ...] = (
    (r"(^|/)embed_tokens/embedding$", P("tensor", "fsdp")),  # [V, d]
    (r"(^|/)lm_head/kernel$", P("fsdp", "tensor")),  # [d, V]
    (r"(^|/)self_attn/[qkv]_proj/kernel$", P("fsdp", "tensor")),  # [d, H*D]
    (r"(^|/)self_attn/[qkv]_proj/bias$", P("tensor")),  # [H*D]
    (r"(^|/)self_attn/o_proj/kernel$", P("tensor", "fsdp")),  # [H*D, d]
    (r"(^|/)self_attn/o_proj/bias$", P()),  # [d]
    (r"(^|/)mlp/(gate|up)_proj/kernel$", P("fsdp", "tensor")),  # [d, F]
    (r"(^|/)mlp/down_proj/kernel$", P("tensor", "fsdp")),  # [F, d]
    (r"(^|/)(input_layernorm|post_attention_layernorm|norm)/weight$", P()),
    (r"(^|/)(pre|post)_feedforward_layernorm/weight$", P()),  # Gemma's MLP norms
    (r"(^|/)self_attn/[qk]_norm/weight$", P()),  # [D]: Qwen3's q/k norms
    (r"(^|/)value_head/(kernel|bias)$", P()),  # [d, 1], [1]: tiny
    (r"(^|/)lora/lora_[ab]$", P()),  # LoRA adapters [din, r], [r, dout]: small
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape; the product must equal the number of devices."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.data, self.fsdp, self.tensor)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh of Auto axes over `devices` (default all)."""
  devices = list(jax.devices() if devices is None else devices)
  if math.prod(cfg.shape) != len(devices):
    raise ValueError(
        f"mesh data={cfg.data} x fsdp={cfg.fsdp} x tensor={cfg.tensor} = "
        f"{math.prod(cfg.shape)} devices, but {len(devices)} devices are given")
  return jax.make_mesh(cfg.shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                       devices=devices)


def mesh_like(cfg: MeshConfig, devices: Sequence[jax.Device]) -> Mesh:
  """A mesh over `devices` shaped like `cfg` for a sampler: keeps
  `cfg.tensor` (a model that needs tensor parallelism to fit needs it to
  sample too) and as much of `cfg.fsdp` as fits; the rest of the devices
  split slots over "data". For one host's devices (`distributed.local_mesh`)
  or the sampler's own (`mesh.sampler_devices`)."""
  n = len(devices)
  if n % cfg.tensor:
    raise ValueError(f"mesh tensor={cfg.tensor} must divide the {n} devices given")
  fsdp = math.gcd(cfg.fsdp, n // cfg.tensor)
  return make_mesh(MeshConfig(data=n // (fsdp * cfg.tensor), fsdp=fsdp, tensor=cfg.tensor),
                   devices)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
  """`spec` with every dimension that its mesh axes do not divide replicated.

  Correct whatever the fallback (a sharding only changes where data lives);
  efficient tensor parallelism also wants the head counts divisible by
  "tensor", so that shards hold whole heads.
  """
  if len(spec) > len(shape):
    raise ValueError(f"spec {spec} has more dimensions than shape {tuple(shape)}")
  out = []
  for dim, axes in zip(shape, spec):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size = math.prod(mesh.shape[a] for a in names)
    out.append(axes if dim % size == 0 else None)
  return P(*out)


def path_str(path: Sequence[Any]) -> str:
  """'/'-joined names of a jax key path; a Variable's own `.value` is dropped."""
  names = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        names.append(str(getattr(key, attr)))
        break
    else:
      names.append(str(key))
  if names and names[-1] == "value":
    names.pop()
  return "/".join(names)


def partition_spec(path: str, shape: Sequence[int], mesh: Mesh,
                   rules: Sequence[tuple[str, P]] = PARTITION_RULES) -> P:
  """The fitted spec of the first rule matching `path`; scalars replicated.

  mesh: a Mesh or an AbstractMesh (only its axis sizes are read).
  """
  if not shape:
    return P()
  for pattern, spec in rules:
    if re.search(pattern, path):
      return fit_spec(spec, shape, mesh)
  raise ValueError(
      f"no partition rule matches parameter {path!r} of shape {tuple(shape)}; "
      "add one to the rules (nothing is replicated silently)")


def param_shardings(tree: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, P]] = PARTITION_RULES) -> Any:
  """Tree of NamedSharding matching `tree` (params, a TrainState, abstract
  ShapeDtypeStructs...); optimizer moments follow their parameter's rule
  because their paths end with the parameter's path."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(
          mesh, partition_spec(path_str(path), x.shape, mesh, rules)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """For every [B, ...] TokenBatch array: rows over ("data", "fsdp").

  B must divide by data x fsdp (jit says so otherwise): dropping data
  parallelism silently would hide a misconfigured batch size.
  """
  return NamedSharding(mesh, P(ROWS))


def rows_sharding(tree: Any, mesh: Mesh) -> Any:
  """Tree of NamedSharding: each leaf's leading dimension (rows, slots) over
  ("data", "fsdp") where it divides; scalars replicated."""
  return jax.tree.map(
      lambda x: NamedSharding(mesh, fit_spec(P(ROWS), x.shape, mesh) if x.shape else P()),
      tree)


def cache_sharding(cache: Any, mesh: Mesh) -> Any:
  """Tree of NamedSharding for a KVCache (leaves [B, KV, ...]): slots over
  ("data", "fsdp"), kv heads over "tensor", each where it divides.

  Sharding kv heads like the k/v projections' output keeps attention local to
  a tensor shard.
  """
  return jax.tree.map(
      lambda x: NamedSharding(mesh, fit_spec(P(ROWS, "tensor"), x.shape, mesh)), cache)


def shard(tree: Any, shardings: Any) -> Any:
  """Places `tree` on its `shardings` (device to device for device arrays)."""
  return jax.device_put(tree, shardings)


def abstract_state(tree: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `tree`'s leaves (arrays or structs) carrying
  `shardings`: the `abstract_state` that makes `Checkpointer.restore` load
  straight onto a mesh, e.g. `abstract_state(jax.eval_shape(init),
  param_shardings(...))`."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
