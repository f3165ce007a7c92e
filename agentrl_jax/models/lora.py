"""LoRA adapters on the decoder's linears (flax's `nnx.LoRA`), and merging.

`add_adapters(model, cfg)` attaches an `nnx.LoRA` (A [din, r], he-uniform;
B [r, dout], zeros, so the model starts as the base) to every linear named
in `cfg.target_modules`; the linear then computes x W + b + (alpha / r) x A B
(`decoder._Linear`). Adapters are `nnx.LoRAParam`s in float32 whatever the
base's dtype. `TRAINABLE` selects what a LoRA run trains: the adapters and
the value head (small, and new: it has no base to adapt). `merge` folds the
adapters into the kernels, W + (alpha / r) A B: `save_pretrained` exports
an adapted model so, as the plain decoder HF loaders know.

Not qwix: its LoRA intercepts `jax.lax.dot_general` while the model's method
runs, and the backward pass of `models.decoder.remat` recomputes each layer
after that method has returned, so under remat the adapters silently got
zero gradients.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

from agentrl_jax.checks import check_fields
from agentrl_jax.models.decoder import Decoder, _Linear

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What a LoRA run trains; everything else is the frozen base.
TRAINABLE = nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int = 0  # 0: no adapters (full fine-tuning)
  alpha: float = 16.0  # the update is scaled by alpha / rank
  target_modules: tuple[str, ...] = LINEARS  # names among LINEARS

  def __post_init__(self):
    unknown = sorted(set(self.target_modules) - set(LINEARS))
    check_fields(self, [
        ("rank", self.rank >= 0, "must be >= 0 (0: full fine-tuning)"),
        ("alpha", self.alpha > 0, "must be > 0"),
        ("target_modules", bool(self.target_modules) and not unknown,
         f"must name some of {LINEARS}" + (f"; unknown: {unknown}" if unknown else "")),
    ])


def add_adapters(model: Decoder, cfg: LoraConfig, rngs: nnx.Rngs) -> Decoder:
  """`model` with an adapter on each targeted linear (in place; returned).

  rngs: the adapters' own stream (the base is already drawn: its weights
  are those of the model without adapters). rank 0 adds none.
  """
  if cfg.rank == 0:
    return model
  for path, module in nnx.iter_modules(model):
    if isinstance(module, _Linear) and path and path[-1] in cfg.target_modules:
      din, dout = module.kernel.shape
      module.lora = nnx.LoRA(din, cfg.rank, dout, dtype=model.cfg.dtype,
                             param_dtype=jnp.float32, rngs=rngs)
      module.lora_scale = cfg.alpha / cfg.rank
  return model


def has_adapters(model: Decoder) -> bool:
  return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def merge(model: Decoder) -> Decoder:
  """A copy of `model` without adapters whose kernels are W + (alpha / r) A B
  (summed in float32, stored in the kernel's dtype): the function the
  adapted model computes, as a plain decoder for `save_pretrained`."""
  model = nnx.clone(model)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, _Linear) and module.lora is not None:
      kernel = module.kernel[...]
      delta = module.lora.lora_a[...] @ module.lora.lora_b[...]
      module.kernel[...] = (kernel.astype(jnp.float32) + module.lora_scale * delta
                            ).astype(kernel.dtype)
      del module.lora, module.lora_scale
  return model
