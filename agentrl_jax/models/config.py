"""Decoder configuration: one frozen, hashable dataclass for Llama, Qwen2, Qwen3.

Hashable so it can be a static argument of jitted functions. Converted from
and to Hugging Face configs (transformers' `AutoConfig`), so a local
checkpoint's `config.json` is the single source of truth.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a Llama/Qwen2/Qwen3-family decoder."""

  arch: str  # one of SUPPORTED_ARCHS: the HF model_type
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int  # per head; Qwen3's is not hidden_size // num_heads
  rope_theta: float = 10000.0
  rope_type: str = "default"  # one of ROPE_TYPES
  rope_factor: float = 1.0  # "linear" and "llama3"
  rope_low_freq_factor: float = 1.0  # "llama3"
  rope_high_freq_factor: float = 4.0  # "llama3"
  rope_original_max_positions: int = 8192  # "llama3"
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2: True
  o_bias: bool = False
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
  max_position_embeddings: int = 4096
  dtype: Any = jnp.float32  # activations (norms and softmax always float32)
  # The trained (master) weights: float32 also under bf16 activations, or
  # a small update rounds back to where it was (`compute_params` makes the
  # compute-dtype copies the sampler and the KL reference hold).
  param_dtype: Any = jnp.float32
  value_head: bool = False  # scalar value per token from the final hidden state
  remat: bool = False  # recompute each layer's activations in the backward pass

  def __post_init__(self):
    if self.arch not in SUPPORTED_ARCHS:
      raise ValueError(f"unsupported arch {self.arch!r}; supported: {SUPPORTED_ARCHS}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {ROPE_TYPES}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads}")

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
  """A 2-layer, d=128 model for tests and the embedded default run.

  Qwen3's heads are 64 wide (4 x 64 = 256 != d), as its real models' are
  (Qwen3-0.6B: d = 1024, 16 heads of 128), with the q/k norms.
  """
  base = dict(
      arch=arch, vocab_size=512, hidden_size=128, intermediate_size=256,
      num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=64 if arch == "qwen3" else 32,
      rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
      tie_word_embeddings=arch in ("llama", "qwen3"), qkv_bias=arch == "qwen2",
      qk_norm=arch == "qwen3")
  base.update(overrides)
  return ModelConfig(**base)


def _rope_parameters(hf) -> dict:
  """transformers 5 keeps rope settings in `rope_parameters`; older ones split."""
  params = getattr(hf, "rope_parameters", None)
  if params:
    return dict(params)
  params = dict(getattr(hf, "rope_scaling", None) or {})
  params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
  return params


def from_hf_config(hf, **overrides) -> ModelConfig:
  """Converts a transformers Llama/Qwen2/Qwen3 config; raises on what we don't model."""
  arch = getattr(hf, "model_type", None)
  if arch not in SUPPORTED_ARCHS:
    raise ValueError(
        f"unsupported architecture {arch!r} (config.json model_type); "
        f"supported: {SUPPORTED_ARCHS}")
  if getattr(hf, "hidden_act", "silu") != "silu":
    raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; only 'silu'")
  if getattr(hf, "mlp_bias", False):
    raise ValueError("unsupported: mlp_bias=True")
  if getattr(hf, "use_sliding_window", False):
    raise ValueError("unsupported: use_sliding_window=True (sliding-window attention)")
  rope = _rope_parameters(hf)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {ROPE_TYPES}")
  heads = hf.num_attention_heads
  attention_bias = bool(getattr(hf, "attention_bias", False))
  fields = dict(
      arch=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
      intermediate_size=hf.intermediate_size,
      num_layers=hf.num_hidden_layers, num_heads=heads,
      num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
      head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
      rope_theta=float(rope.get("rope_theta", 10000.0)), rope_type=rope_type,
      rope_factor=float(rope.get("factor", 1.0)),
      rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
      rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
      rope_original_max_positions=int(
          rope.get("original_max_position_embeddings", 8192)),
      rms_norm_eps=float(hf.rms_norm_eps),
      tie_word_embeddings=bool(hf.tie_word_embeddings),
      qkv_bias=True if arch == "qwen2" else attention_bias,
      o_bias=False if arch == "qwen2" else attention_bias,
      qk_norm=arch == "qwen3",
      max_position_embeddings=hf.max_position_embeddings)
  fields.update(overrides)
  return ModelConfig(**fields)


def to_hf_config(cfg: ModelConfig, base: dict | None = None):
  """A transformers config for `cfg` (fields of `base`, e.g. token ids, kept)."""
  import transformers  # pylint: disable=g-import-not-at-top

  rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
  if cfg.rope_type in ("linear", "llama3"):
    rope["factor"] = cfg.rope_factor
  if cfg.rope_type == "llama3":
    rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_positions)
  fields = dict(base or {})
  for key in ("transformers_version", "architectures", "rope_scaling", "dtype",
              "torch_dtype"):
    fields.pop(key, None)
  fields.update(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
      max_position_embeddings=cfg.max_position_embeddings,
      rope_parameters=rope, hidden_act="silu")
  if cfg.qk_norm != (cfg.arch == "qwen3"):
    raise ValueError(f"qk_norm={cfg.qk_norm} has no {cfg.arch} checkpoint: "
                     "Qwen3 always has q/k norms, Llama and Qwen2 never")
  if cfg.arch in ("llama", "qwen3") and cfg.qkv_bias != cfg.o_bias:
    raise ValueError(f"{cfg.arch} has one attention_bias flag for q, k, v and o")
  if cfg.arch == "llama":
    fields.update(attention_bias=cfg.qkv_bias, mlp_bias=False)
    hf = transformers.LlamaConfig(**fields)
    hf.architectures = ["LlamaForCausalLM"]
  elif cfg.arch == "qwen3":
    fields.update(attention_bias=cfg.qkv_bias)
    hf = transformers.Qwen3Config(**fields)
    hf.architectures = ["Qwen3ForCausalLM"]
  else:
    hf = transformers.Qwen2Config(**fields)
    hf.architectures = ["Qwen2ForCausalLM"]
  hf.dtype = jnp.dtype(cfg.param_dtype).name
  return hf
