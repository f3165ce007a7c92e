"""Flax NNX decoder for the Llama / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 family, with
an optional KV cache.

One forward serves the trainer and the sampler, so both compute the same
function:
- training: `model(tokens, positions, seq_ids, prefix_ids)`; attention is
  causal and never crosses `seq_ids` (packed rows, padding = -1) except
  into a shared prompt (`prefix_ids`, tree rows), as in
  `trajectory.attention_mask`;
- sampling: `model.hidden_states(tokens, positions, cache=cache)` writes the
  new keys/values into the cache at `positions` and attends to every cached
  key at a position <= the query's.

Numerics follow the transformers implementation: RMSNorm and the attention
softmax in float32 whatever the activation dtype, RoPE in the "rotate half"
layout, grouped-query attention; Qwen3's q/k RMSNorm over each head's
features, before RoPE. Gemma (`ModelConfig.gemma`) adds (1 + w) norms around
attention and MLP, scaled embeddings, GeGLU, soft-capped scores and logits,
and sliding-window layers: the window is a mask over positions (the cache
keeps every position), so all three paths share it.
"""

from __future__ import annotations

import functools
import math

import chex
import flax.struct
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.models.config import ModelConfig
from agentrl_jax.trajectory import attention_mask

_MASKED = float(np.finfo(np.float32).min)


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer for S positions of B sequences (slots).

  A slot's positions must be written contiguously from 0: a query at
  position p attends to every cached position <= p, so whatever a released
  slot left beyond its new length is never read.

  Keys are stored transposed, positions last: the score dot q.K then
  contracts the keys' leading feature axis, as probs.V does the values';
  XLA:CPU ran it several times slower on their minor axis (the profile in
  docs/results.md; `benchmarks/decode_vs_commit.py` times the step).
  """

  k: tuple[jax.Array, ...]  # per layer [B, KV, D, S]
  v: tuple[jax.Array, ...]  # per layer [B, KV, S, D]

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, length: int) -> KVCache:
    b, kv, d = batch, cfg.num_kv_heads, cfg.head_dim
    layers = range(cfg.num_layers)
    return cls(k=tuple(jnp.zeros((b, kv, d, length), cfg.dtype) for _ in layers),
               v=tuple(jnp.zeros((b, kv, length, d), cfg.dtype) for _ in layers))

  @property
  def length(self) -> int:
    return self.v[0].shape[2]


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """[D/2] inverse frequencies, with Llama-3 or linear scaling applied."""
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  if cfg.rope_type == "linear":
    inv = inv / cfg.rope_factor
  elif cfg.rope_type == "llama3":
    # Long wavelengths are slowed by `factor`, short ones kept, and the band
    # in between interpolated (Llama 3.1's `_compute_llama3_parameters`).
    old = cfg.rope_original_max_positions
    low_wavelen = old / cfg.rope_low_freq_factor
    high_wavelen = old / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
    smooth = ((old / wavelen - cfg.rope_low_freq_factor)
              / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, scaled)
  return inv.astype(np.float32)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, L, 1, D] float32 for positions [B, L], shared by all layers."""
  angles = positions[..., None].astype(jnp.float32) * rope_inv_freq(cfg)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotates x [B, L, H, D] by `rope_tables` ("rotate half" layout)."""
  cos, sin = rope
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
          ).astype(x.dtype)


class RMSNorm(nnx.Module):
  """x / rms(x) * w; Gemma's (`plus_one`) scales by (1 + w), w stored as is
  (0 at initialisation), in float32 before the cast, as transformers'
  Gemma2RMSNorm. w is rounded to the activation dtype first (what a model
  stored in that dtype holds), so float32 masters compute what
  `compute_params` copies compute."""

  def __init__(self, dim: int, eps: float, dtype, param_dtype, plus_one: bool = False):
    self.weight = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), param_dtype))
    self.eps, self.dtype, self.plus_one = eps, dtype, plus_one

  def __call__(self, x: jax.Array) -> jax.Array:
    # Normalise in float32 (a bf16 mean of squares loses the small entries).
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + self.eps)
    if self.plus_one:
      w32 = self.weight[...].astype(self.dtype).astype(jnp.float32)
      return (x32 * (1.0 + w32)).astype(self.dtype)
    return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
  return RMSNorm(dim, cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype, plus_one=cfg.gemma)


class _Linear(nnx.Linear):
  """nnx.Linear on a 2-D view: the weight gradient of an [..., din] input
  contracts over every leading axis, and XLA:CPU runs a dot with several
  contracting axes on a slow generic path (the step's time:
  benchmarks/README.md).

  `lora`: None, or an `nnx.LoRA` adapter that `models.lora.add_adapters`
  attaches: y = x W + b + lora_scale * (x A) B, unmerged, in the compute
  dtype like every weight.
  """

  lora: nnx.LoRA | None = None
  lora_scale: float = 0.0  # alpha / rank

  def __call__(self, x: jax.Array) -> jax.Array:
    x2 = x.reshape(-1, x.shape[-1])
    y = super().__call__(x2)
    if self.lora is not None:
      y = y + self.lora(x2) * self.lora_scale
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _linear(cfg: ModelConfig, din: int, dout: int, bias: bool, rngs: nnx.Rngs):
  return _Linear(
      din, dout, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


class _Embed(nnx.Embed):
  """nnx.Embed that gathers rows before casting them to the compute dtype
  (nnx.Embed casts the whole [V, d] table first: a vocabulary-sized copy,
  which XLA hoists out of the train step's loops and keeps), and whose
  `attend` contracts the table's feature axis in place (no transposed copy).
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("token ids must be integers")
    return jnp.take(self.embedding[...], inputs, axis=0).astype(self.dtype)

  def attend(self, query: jax.Array) -> jax.Array:
    query, table = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
    return jnp.einsum("...d,vd->...v", query, table)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, hd = cfg.hidden_size, cfg.head_dim
    self.q_proj = _linear(cfg, d, cfg.num_heads * hd, cfg.qkv_bias, rngs)
    self.k_proj = _linear(cfg, d, cfg.num_kv_heads * hd, cfg.qkv_bias, rngs)
    self.v_proj = _linear(cfg, d, cfg.num_kv_heads * hd, cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, cfg.num_heads * hd, d, cfg.o_bias, rngs)
    self.q_norm = _norm(cfg, hd) if cfg.qk_norm else None
    self.k_norm = _norm(cfg, hd) if cfg.qk_norm else None
    # Scores are q.k / denom, soft-capped (Gemma 2) before the mask.
    self.denom = math.sqrt(cfg.query_pre_attn_scalar or hd)

  def __call__(self, x, positions, rope, mask, cache_kv):
    """x [B, L, d]; mask [B, L, S] bool; cache_kv None or a layer's cached
    keys [B, KV, D, S] and values [B, KV, S, D] (`KVCache`)."""
    cfg = self.cfg
    b, l, _ = x.shape
    kv, g, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    q = self.q_proj(x).reshape(b, l, cfg.num_heads, hd)
    k = self.k_proj(x).reshape(b, l, kv, hd)
    if cfg.qk_norm:  # per head, over its hd features (transformers' Qwen3, Gemma 3)
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    v = self.v_proj(x).reshape(b, l, kv, hd)
    if cache_kv is not None:
      # Write the new entries at their positions (positions >= S are
      # dropped: that is how callers park padding tokens), then attend to
      # the whole cache.
      rows = jnp.arange(b)[:, None]
      k = cache_kv[0].at[rows, :, :, positions].set(k.astype(cache_kv[0].dtype), mode="drop")
      v = cache_kv[1].at[rows, :, positions].set(v.astype(cache_kv[1].dtype), mode="drop")
      cache_kv = (k, v)
    else:
      k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    # Head-major layout ([B, KV, G, L, D] x [B, KV, S, D]): faster than
    # contracting in the token-major layout on XLA:CPU (benchmarks/README.md).
    q = q.reshape(b, l, kv, g, hd).transpose(0, 2, 3, 1, 4)
    if cache_kv is not None:
      out = _attention(q, k, v, mask, self.denom, cfg.attn_logit_softcap, "bkds")[0]
      out = out.astype(v.dtype)
    else:
      # Training rows are causal in index order, so a block of queries needs
      # the keys up to its own end only: the masked upper triangle is
      # skipped (4 blocks of a 256-token row compute 10 of its 16 score
      # tiles; the step's time: benchmarks/README.md).
      edges = _query_blocks(l)
      out = jnp.concatenate(
          [_attend(q[:, :, :, a:e], k[:, :, :e], v[:, :, :e], mask[:, a:e, :e],
                   self.denom, cfg.attn_logit_softcap)
           for a, e in zip(edges, edges[1:])], axis=3)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, l, -1)
    return self.o_proj(out), cache_kv


def _query_blocks(length: int) -> list[int]:
  """Edges of up to 8 query blocks of at least 64 tokens each."""
  n = max(1, min(8, length // 64))
  return [round(i * length / n) for i in range(n + 1)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q, k, v, mask, denom, softcap):
  """q [B, KV, G, L, D], k and v [B, KV, S, D], mask [B, L, S] -> [B, KV, G, L, D].

  Scores are q.k / denom, soft-capped to softcap * tanh(scores / softcap)
  if softcap is not None (Gemma 2), then masked. Its backward is written out
  (`_attend_bwd`): the autodiff one contracts the key gradients over two
  axes (G and L) and sums dP * P over the keys; this one is faster on
  XLA:CPU (benchmarks/README.md).
  """
  return _attend_fwd(q, k, v, mask, denom, softcap)[0]


def _scores(q, k, denom, softcap, keys="bksd"):
  """[B, KV, G, L, S] float32 scores (bf16 exp/sum over long contexts drifts);
  `keys` names k's layout: "bksd", or "bkds" (the cache's)."""
  scores = jnp.einsum(f"bkgld,{keys}->bkgls", q, k,
                      preferred_element_type=jnp.float32) / denom
  return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _attention(q, k, v, mask, denom, softcap, keys):
  """The float32 output [B, KV, G, L, D] and the probabilities [B, KV, G, L, S]."""
  scores = jnp.where(mask[:, None, None], _scores(q, k, denom, softcap, keys), _MASKED)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgls,bksd->bkgld", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out, probs


def _attend_fwd(q, k, v, mask, denom, softcap):
  out, probs = _attention(q, k, v, mask, denom, softcap, "bksd")
  return out.astype(v.dtype), (q, k, v, mask, probs, out)


def _attend_bwd(denom, softcap, res, d_out):
  """The softmax gradient P * (dP - rowsum(dP * P)), its row sum taken as
  rowsum(dO * O) over D, not S (flash attention's identity); zero where
  masked (also in a fully masked row, whose P is uniform). A soft cap's
  derivative 1 - tanh^2 recomputes the scores rather than keep [.., L, S]
  more of them alive from the forward pass."""
  q, k, v, mask, probs, out = res
  b, kv, g, l, _ = q.shape
  # Queries of a KV group as one [G * L] axis: one contracting axis per dot.
  merge = lambda x: x.reshape(b, kv, g * l, x.shape[-1])
  d_v = jnp.einsum("bkns,bknd->bksd", merge(probs.astype(v.dtype)), merge(d_out))
  d_probs = jnp.einsum("bkgld,bksd->bkgls", d_out, v, preferred_element_type=jnp.float32)
  row = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1, keepdims=True)
  d_scores = jnp.where(mask[:, None, None], probs * (d_probs - row), 0.0)
  if softcap is not None:
    d_scores = d_scores * (1.0 - jnp.square(_scores(q, k, denom, softcap) / softcap))
  d_scores = d_scores / denom
  d_q = jnp.einsum("bkgls,bksd->bkgld", d_scores.astype(k.dtype), k)
  d_k = jnp.einsum("bkns,bknd->bksd", merge(d_scores.astype(q.dtype)), merge(q))
  return d_q, d_k, d_v, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _gelu_tanh(x: jax.Array) -> jax.Array:
  """transformers' gelu_pytorch_tanh (a module-level function: a Module's
  static attributes are part of its graphdef, compared by jit caches)."""
  return jax.nn.gelu(x, approximate=True)


class MLP(nnx.Module):
  """Gated MLP: SwiGLU, or Gemma's GeGLU."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _linear(cfg, d, f, False, rngs)
    self.up_proj = _linear(cfg, d, f, False, rngs)
    self.down_proj = _linear(cfg, f, d, False, rngs)
    self.act = _gelu_tanh if cfg.gemma else jax.nn.silu

  def __call__(self, x):
    return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm block. Llama's post_attention_layernorm is its MLP's input
  norm; Gemma's normalises the attention output, and two more norms wrap
  the MLP (transformers' names, so checkpoints map one to one)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.gemma = cfg.gemma
    self.input_layernorm = _norm(cfg, cfg.hidden_size)
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
    self.mlp = MLP(cfg, rngs)
    self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size) if cfg.gemma else None
    self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size) if cfg.gemma else None

  def __call__(self, x, positions, rope, mask, cache_kv):
    h, cache_kv = self.self_attn(self.input_layernorm(x), positions, rope, mask,
                                 cache_kv)
    if self.gemma:
      x = x + self.post_attention_layernorm(h)
      h = self.mlp(self.pre_feedforward_layernorm(x))
      return x + self.post_feedforward_layernorm(h), cache_kv
    x = x + h
    return x + self.mlp(self.post_attention_layernorm(x)), cache_kv


def remat(f):
  """`f(params, x, *consts) -> y` whose backward pass keeps only its inputs
  and recomputes f once the gradient of y has arrived (consts get none).

  Not jax.checkpoint: XLA:CPU drops its optimization barriers and merges
  the recomputation with the forward pass (common-subexpression
  elimination), so over unrolled layers it saves nothing
  (benchmarks/remat_memory.py). Here the recomputation starts from
  x + 0 * (one entry of y's gradient): the same value, which no pass can
  merge with the forward's and no schedule can compute before that
  gradient exists (for layer i: after layer i + 1's backward). The layer's
  weights enter f through `after(params, x)` for the same reason: their
  casts are made where the layer runs, each time it runs.
  """
  def tied(params, x, *consts):
    return f(after(params, x), x, *consts)

  @jax.custom_vjp
  def run(params, x, *consts):
    return tied(params, x, *consts)

  def fwd(params, x, *consts):
    return tied(params, x, *consts), (params, x, consts)

  def bwd(saved, d_y):
    params, x, consts = saved
    x = after(x, d_y)
    _, vjp = jax.vjp(lambda p, h: tied(p, h, *consts), params, x)
    return (*vjp(d_y), *(None,) * len(consts))

  run.defvjp(fwd, bwd)
  return run


def after(tree, x: jax.Array):
  """`tree`'s floating leaves + 0 * (one entry of x): the same values, which
  exist only once x does. Under `remat` each layer's weights go through it,
  so their compute-dtype casts (and XLA:CPU's float32 copies for its dots)
  are made where the layer runs, per micro-batch and again in the backward
  pass, instead of being hoisted out of the loops or shared with the
  forward pass: one layer's copies live at a time, not every layer's."""
  zero = jax.lax.stop_gradient(x[(0,) * x.ndim]) * 0
  return jax.tree.map(lambda a: a + zero.astype(a.dtype)
                      if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _remat_layer(layer, x, positions, rope, mask):
  """`layer(x, ...)` under `remat`: the backward pass keeps the input
  [B, L, d]. The layer crosses as (graphdef, state) and is rebuilt inside,
  so nothing outside is mutated from an inner trace (what nnx.remat does,
  and fails at, under the train step's lax.map). Training only: no cache.
  """
  graphdef, state = nnx.split(layer)

  def run(state, x, positions, rope, mask):
    return nnx.merge(graphdef, state)(x, positions, rope, mask, None)[0]
  return remat(run)(state, x, positions, rope, mask)


def compute_params(params, dtype):
  """Fresh device copies of `params` with floating leaves in `dtype`.

  Every layer casts its weights to the activation dtype before use, so a
  copy in that dtype computes exactly what the float32 masters compute:
  the sampler's weights and the KL reference hold this, at half the bytes
  under bf16.
  """
  dtype = jnp.dtype(dtype)
  cast = lambda x: (x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                    and x.dtype != dtype else jnp.copy(x))
  return jax.tree.map(cast, params)


class Decoder(nnx.Module):
  """Llama/Qwen2/Qwen3/Gemma decoder: tokens [B, L] -> logits [B, L, V] (+ values [B, L])."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = _Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = _norm(cfg, cfg.hidden_size)
    self.lm_head = (None if cfg.tie_word_embeddings
                    else _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs))
    self.value_head = (_linear(cfg, cfg.hidden_size, 1, True, rngs)
                       if cfg.value_head else None)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """[B, L] ids -> [B, L, d] in the activation dtype; Gemma's times
    sqrt(d) rounded to that dtype first, as transformers (bf16 makes
    sqrt(3072) = 55.43 into 55.5)."""
    x = self.embed_tokens(tokens)
    if not self.cfg.gemma:
      return x
    return x * jnp.asarray(math.sqrt(self.cfg.hidden_size), jnp.float32).astype(x.dtype)

  def hidden_states(self, tokens: jax.Array, positions: jax.Array, *,
                    seq_ids: jax.Array | None = None,
                    prefix_ids: jax.Array | None = None,
                    cache: KVCache | None = None
                    ) -> tuple[jax.Array, KVCache | None]:
    """Final-normed hidden states [B, L, d], and the updated cache.

    Args:
      tokens: [B, L] int token ids.
      positions: [B, L] int position of each token in its own sequence.
      seq_ids: [B, L] int sequence id (-1 on padding); training only. None
        means one sequence per row.
      prefix_ids: [B, L] int shared-prompt ids of tree rows
        (`TokenBatch.prefix_ids`), or None; training only.
      cache: a KVCache to write into and attend over (sampling), or None.
    """
    chex.assert_rank([tokens, positions], 2)
    chex.assert_equal_shape([tokens, positions])
    cfg = self.cfg
    if cache is None:
      if seq_ids is None:
        seq_ids = jnp.zeros(tokens.shape, jnp.int32)
      mask = attention_mask(seq_ids, prefix_ids)
      key_positions = positions
    else:
      if seq_ids is not None or prefix_ids is not None:
        raise ValueError("seq_ids and prefix_ids are for training batches; a cache has slots")
      key_positions = jnp.arange(cache.length)[None]
      mask = key_positions[:, None, :] <= positions[:, :, None]
    x = self.embed(tokens)
    # Per attention kind, once, not per layer: (rope, mask) of global layers
    # and of sliding ones (a window over positions; own RoPE base in Gemma 3).
    rope = rope_tables(positions, cfg)
    kinds = {False: (rope, mask)}
    if any(cfg.sliding_layers):
      local_rope = rope if cfg.rope_local_theta is None else rope_tables(
          positions, cfg.replace(rope_type="default", rope_theta=cfg.rope_local_theta))
      near = positions[:, :, None] - key_positions[:, None, :] < cfg.sliding_window
      kinds[True] = (local_rope, mask & near)
    new_cache = None
    if cache is None:
      # Remat is for training's backward pass; a sampler's cached steps have none.
      for i, layer in enumerate(self.layers):
        layer_rope, layer_mask = kinds[cfg.is_sliding(i)]
        x = (_remat_layer(layer, x, positions, layer_rope, layer_mask) if cfg.remat
             else layer(x, positions, layer_rope, layer_mask, None)[0])
    else:
      new_k, new_v = [], []
      for i, layer in enumerate(self.layers):
        layer_rope, layer_mask = kinds[cfg.is_sliding(i)]
        x, (k, v) = layer(x, positions, layer_rope, layer_mask, (cache.k[i], cache.v[i]))
        new_k.append(k)
        new_v.append(v)
      new_cache = KVCache(k=tuple(new_k), v=tuple(new_v))
    return self.norm(x), new_cache

  def logits(self, hidden: jax.Array) -> jax.Array:
    """[..., d] -> [..., V] in the activation dtype (soft-capped in float32)."""
    logits = (self.embed_tokens.attend(hidden) if self.lm_head is None
              else self.lm_head(hidden))
    cap = self.cfg.final_logit_softcap
    if cap is None:
      return logits
    return (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)

  def values(self, hidden: jax.Array) -> jax.Array:
    """[..., d] -> [...] float32 scalar values (needs cfg.value_head)."""
    if self.value_head is None:
      raise ValueError("this model has no value head; build it with value_head=True")
    return self.value_head(hidden)[..., 0].astype(jnp.float32)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               seq_ids: jax.Array | None = None,
               prefix_ids: jax.Array | None = None) -> jax.Array:
    """Training forward: logits [B, L, V]; positions default to 0..L-1."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = self.hidden_states(tokens, positions, seq_ids=seq_ids, prefix_ids=prefix_ids)
    return self.logits(hidden)
