"""Decoder configuration: one frozen, hashable dataclass for Llama, Qwen2,
Qwen3, Gemma 2 and Gemma 3 (text).

Hashable so it can be a static argument of jitted functions. Converted from
and to Hugging Face configs (transformers' `AutoConfig`), so a local
checkpoint's `config.json` is the single source of truth.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text")
GEMMA_ARCHS = ("gemma2", "gemma3_text")
ROPE_TYPES = ("default", "linear", "llama3")
_LAYER_TYPES = ("sliding_attention", "full_attention")  # HF's layer_types values


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a Llama/Qwen2/Qwen3/Gemma-family decoder.

  The Gemma structure follows from `arch` (see `gemma`); its numeric
  settings are the fields below `qk_norm`.
  """

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
  qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k, before RoPE
  # Attention scores are q.k / sqrt(query_pre_attn_scalar) (Gemma); None: head_dim.
  query_pre_attn_scalar: float | None = None
  attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
  final_logit_softcap: float | None = None  # Gemma 2/3: logits -> cap * tanh(logits / cap)
  # On a sliding layer a query at position p sees keys at p - window < k <= p.
  sliding_window: int | None = None
  sliding_layers: tuple[bool, ...] = ()  # per layer: sliding window? () = none
  # Gemma 3: sliding layers use default RoPE with this base; global layers
  # use rope_theta/rope_type above. None: every layer uses the latter.
  rope_local_theta: float | None = None
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
    if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
      raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries "
                       f"for {self.num_layers} layers")
    if any(self.sliding_layers) and not self.sliding_window:
      raise ValueError("sliding layers need a sliding_window")

  @property
  def gemma(self) -> bool:
    """Gemma 2/3 structure: RMSNorms scale by (1 + weight) in float32, a norm
    on the attention and MLP outputs too (4 per layer), embeddings times
    sqrt(hidden_size) in the activation dtype, GeGLU (tanh-approximated GELU)."""
    return self.arch in GEMMA_ARCHS

  def is_sliding(self, layer: int) -> bool:
    return bool(self.sliding_layers) and self.sliding_layers[layer]

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
  """A 2-layer, d=128 model for tests and the embedded default run.

  Qwen3's and Gemma's heads are 64 wide (4 x 64 = 256 != d), as their real
  models' are (Qwen3-0.6B: d = 1024, 16 heads of 128), with the q/k norms of
  Qwen3 and Gemma 3. Gemma's layers alternate sliding (window 16) and global
  attention (Gemma 2's pattern; Gemma 3's five sliding per global layer
  would leave two layers without a global one); Gemma 2 soft-caps as its
  real models (50, 30); Gemma 3's sliding layers have their own RoPE base.
  """
  gemma = arch in GEMMA_ARCHS
  base = dict(
      arch=arch, vocab_size=512, hidden_size=128, intermediate_size=256,
      num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=64 if arch in ("qwen3", *GEMMA_ARCHS) else 32,
      rope_theta=1e6 if arch == "gemma3_text" else 10000.0, rms_norm_eps=1e-6,
      max_position_embeddings=2048,
      tie_word_embeddings=arch != "qwen2", qkv_bias=arch == "qwen2",
      qk_norm=arch in ("qwen3", "gemma3_text"))
  if gemma:
    base.update(query_pre_attn_scalar=64, sliding_window=16,
                sliding_layers=tuple(i % 2 == 0 for i in range(
                    overrides.get("num_layers", base["num_layers"]))))
  if arch == "gemma2":
    base.update(attn_logit_softcap=50.0, final_logit_softcap=30.0)
  if arch == "gemma3_text":
    base.update(rope_local_theta=10000.0)
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


def _gemma_fields(hf, arch: str) -> dict:
  """The Gemma-only fields of a Gemma2Config / Gemma3TextConfig."""
  if getattr(hf, "use_bidirectional_attention", False):
    raise ValueError("unsupported: use_bidirectional_attention=True")
  if arch == "gemma3_text" and hf.attn_logit_softcapping is not None:
    raise ValueError("attn_logit_softcapping is set, but transformers' Gemma 3 "
                     "never applies it; refusing to guess")
  layer_types = tuple(hf.layer_types)
  if set(layer_types) - set(_LAYER_TYPES):
    raise ValueError(f"unsupported layer_types {layer_types}; known: {_LAYER_TYPES}")
  return dict(
      query_pre_attn_scalar=hf.query_pre_attn_scalar,
      attn_logit_softcap=hf.attn_logit_softcapping,
      final_logit_softcap=hf.final_logit_softcapping,
      sliding_window=hf.sliding_window,
      sliding_layers=tuple(t == "sliding_attention" for t in layer_types))


def from_hf_config(hf, **overrides) -> ModelConfig:
  """Converts a transformers Llama/Qwen2/Qwen3/Gemma 2/Gemma 3 text config;
  raises on what we don't model."""
  arch = getattr(hf, "model_type", None)
  if arch == "gemma3":
    raise ValueError("model_type 'gemma3' is the multimodal Gemma 3; only its "
                     "text-only checkpoints (model_type gemma3_text) are supported")
  if arch not in SUPPORTED_ARCHS:
    raise ValueError(
        f"unsupported architecture {arch!r} (config.json model_type); "
        f"supported: {SUPPORTED_ARCHS}")
  gemma = arch in GEMMA_ARCHS
  act, want_act = ((getattr(hf, "hidden_activation", None), "gelu_pytorch_tanh")
                   if gemma else (getattr(hf, "hidden_act", "silu"), "silu"))
  if act != want_act:
    raise ValueError(f"unsupported hidden activation {act!r} for {arch}; only {want_act!r}")
  if getattr(hf, "mlp_bias", False):
    raise ValueError("unsupported: mlp_bias=True")
  if getattr(hf, "use_sliding_window", False):
    raise ValueError("unsupported: use_sliding_window=True (sliding-window attention)")
  rope = _rope_parameters(hf)
  local_theta = None
  if arch == "gemma3_text":  # rope settings per layer type
    rope, local = dict(rope["full_attention"]), rope["sliding_attention"]
    if local.get("rope_type", "default") != "default":
      raise ValueError(f"unsupported rope type {local['rope_type']!r} on sliding "
                       "layers; only 'default'")
    local_theta = float(local["rope_theta"])
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
      qk_norm=arch in ("qwen3", "gemma3_text"),
      rope_local_theta=local_theta,
      max_position_embeddings=hf.max_position_embeddings)
  if gemma:
    fields.update(_gemma_fields(hf, arch))
  fields.update(overrides)
  return ModelConfig(**fields)


_HF_CLASSES = {  # arch -> (config class, model class) in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def _check_exportable(cfg: ModelConfig) -> None:
  """Raises on settings that no checkpoint of cfg.arch can hold."""
  if cfg.qk_norm != (cfg.arch in ("qwen3", "gemma3_text")):
    raise ValueError(f"qk_norm={cfg.qk_norm} has no {cfg.arch} checkpoint: "
                     "Qwen3 always has q/k norms (and Gemma 3), Llama, Qwen2 "
                     "and Gemma 2 never")
  if cfg.arch != "qwen2" and cfg.qkv_bias != cfg.o_bias:
    raise ValueError(f"{cfg.arch} has one attention_bias flag for q, k, v and o")
  gemma_only = dict(query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                    attn_logit_softcap=cfg.attn_logit_softcap,
                    final_logit_softcap=cfg.final_logit_softcap,
                    sliding_window=cfg.sliding_window,
                    sliding_layers=any(cfg.sliding_layers),
                    rope_local_theta=cfg.rope_local_theta)
  if not cfg.gemma and any(v for v in gemma_only.values()):
    raise ValueError(f"{[k for k, v in gemma_only.items() if v]} have no "
                     f"{cfg.arch} checkpoint (Gemma settings)")
  if cfg.arch == "gemma2" and cfg.rope_local_theta is not None:
    raise ValueError("gemma2 has one RoPE for all layers: rope_local_theta must be None")
  if cfg.arch == "gemma3_text" and (cfg.rope_local_theta is None
                                    or cfg.attn_logit_softcap is not None):
    raise ValueError("gemma3_text needs rope_local_theta (its sliding layers' "
                     "RoPE base) and no attn_logit_softcap (transformers' "
                     "Gemma 3 never applies it)")


def to_hf_config(cfg: ModelConfig, base: dict | None = None):
  """A transformers config for `cfg` (fields of `base`, e.g. token ids, kept)."""
  import transformers  # pylint: disable=g-import-not-at-top

  _check_exportable(cfg)
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
      rope_parameters=rope)
  if cfg.arch != "qwen2":  # Qwen2's biases are fixed: q/k/v yes, o no
    fields.update(attention_bias=cfg.qkv_bias)
  if cfg.arch == "llama":
    fields.update(mlp_bias=False)
  if cfg.gemma:
    fields.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
        attn_logit_softcapping=cfg.attn_logit_softcap,
        final_logit_softcapping=cfg.final_logit_softcap,
        sliding_window=cfg.sliding_window,
        layer_types=[_LAYER_TYPES[0] if cfg.is_sliding(i) else _LAYER_TYPES[1]
                     for i in range(cfg.num_layers)])
  else:
    fields.update(hidden_act="silu")
  if cfg.arch == "gemma3_text":
    fields.update(rope_parameters={
        "full_attention": rope,
        "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}})
  config_class, model_class = _HF_CLASSES[cfg.arch]
  hf = getattr(transformers, config_class)(**fields)
  hf.architectures = [model_class]
  hf.dtype = jnp.dtype(cfg.param_dtype).name
  return hf
