"""Train state and optimiser: everything the jitted step carries across calls."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
from flax import nnx
import jax
import jax.numpy as jnp
import optax

from agentrl_jax.checks import check_fields
from agentrl_jax.models import compute_params, lora


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 1e-5
  warmup_steps: int = 10
  total_steps: int = 1000  # cosine decay horizon (optimizer updates)
  end_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  clip_norm: float = 1.0  # global-norm gradient clipping

  def __post_init__(self):
    check_fields(self, [
        ("learning_rate", self.learning_rate > 0, "must be > 0"),
        ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
        ("clip_norm", self.clip_norm > 0, "must be > 0"),
    ])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """AdamW with linear warm-up, cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.end_lr_fraction)
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


@flax.struct.dataclass
class TrainState:
  params: Any  # nnx.State of the trained nnx.Param variables (all, or LoRA's)
  opt_state: Any  # optax state over `params`
  ref_params: Any  # frozen reference policy params (like `params`), or None (no KL term)
  step: jax.Array  # int32, optimizer updates applied
  skipped: jax.Array  # int32, updates skipped for non-finite loss/grads
  # LoRA: the frozen base (every parameter not in `params`), in the compute
  # dtype; None under full fine-tuning.
  frozen: Any = None

  @property
  def model_params(self):
    """The whole model's parameters: `params` over the frozen base."""
    return model_params(self.frozen, self.params)


def model_params(frozen, params):
  """`params` (trained) merged over `frozen` (the base; None: nothing to merge)."""
  return params if frozen is None else nnx.merge_state(frozen, params)


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation, *,
                     with_reference: bool) -> tuple[nnx.GraphDef, TrainState]:
  """Splits the model into (graphdef, TrainState).

  The state holds device copies of the parameters: the train step donates
  its state, which must not delete arrays the model still uses. They keep
  the model's `param_dtype` (float32 masters; the optimizer's moments
  follow them). The reference policy is a copy in the compute dtype
  (`reference_params`).

  A model with LoRA adapters (`models.lora.add_adapters`) trains only
  `lora.TRAINABLE` (the adapters and a value head): gradients and moments
  exist for those alone, and the reference copies those alone (with the
  base it is the model at the start). The base goes to `frozen` in the
  compute dtype: it never updates and every forward casts it to that dtype
  anyway, so it gives the masters' function in half the bytes under bf16.
  """
  frozen = None
  if lora.has_adapters(model):
    graphdef, params, frozen = nnx.split(model, lora.TRAINABLE, nnx.Param)
    frozen = compute_params(frozen, model.cfg.dtype)
  else:
    graphdef, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(jnp.copy, params)
  ref = reference_params(params, model.cfg.dtype) if with_reference else None
  return graphdef, TrainState(
      params=params, opt_state=tx.init(params), ref_params=ref,
      step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32), frozen=frozen)


def reference_params(params, dtype):
  """The frozen KL reference: `params` copied in the compute `dtype`. It only
  runs forwards, which cast every weight to that dtype anyway, so it gives
  the masters' log-probs exactly, in half the bytes under bf16."""
  return compute_params(params, dtype)


def checkpointed(state: TrainState) -> TrainState:
  """What a checkpoint holds: everything but the frozen base, which a
  resumed run rebuilds from where it came from (`model.path`, the seed)."""
  return state.replace(frozen=None)
