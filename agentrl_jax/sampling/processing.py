"""Per-slot sampling controls: temperature, top-k, top-p, greedy.

All controls are [B] arrays, so changing them between calls never
recompiles. Every function runs in float32.
"""

from __future__ import annotations

import chex
import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class SamplingParams:
  """Per-slot controls; build with `SamplingParams.make`."""

  temperature: jax.Array  # [B] float32; 0 = greedy (argmax)
  top_k: jax.Array  # [B] int32; 0 = off
  top_p: jax.Array  # [B] float32; 1 = off

  @classmethod
  def make(cls, batch: int, *, temperature=1.0, top_k=0, top_p=1.0) -> SamplingParams:
    full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (batch,))
    return cls(temperature=full(temperature, jnp.float32),
               top_k=full(top_k, jnp.int32), top_p=full(top_p, jnp.float32))


def _filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Masks (to -inf) tokens outside each row's top-k, then outside the top-p
  nucleus of the renormalised top-k distribution.

  As transformers' `TopKLogitsWarper` then `TopPLogitsWarper` (and vLLM):
  top-k keeps every token at least as likely as the k-th; top-p then drops,
  in ascending order, the tokens whose cumulative mass is <= 1 - top_p,
  always keeping the most likely one. A token's fate depends on its value
  only: tokens tied at a cut are kept or dropped together (transformers
  keeps whichever of them its unstable sort puts last).
  """
  vocab = logits.shape[-1]
  ascending = jnp.sort(logits, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(ascending, (vocab - k)[:, None], axis=-1)
  probs = jax.nn.softmax(jnp.where(ascending >= kth, ascending, -jnp.inf), axis=-1)
  dropped = jnp.sum(jnp.cumsum(probs, axis=-1) <= 1.0 - top_p[:, None], axis=-1)
  pth = jnp.take_along_axis(ascending, jnp.minimum(dropped, vocab - 1)[:, None], axis=-1)
  return jnp.where(logits >= jnp.maximum(kth, pth), logits, -jnp.inf)


# Tokens per block of the two-level draw: one lane row on a TPU.
_BLOCK = 128


def draw(u: jax.Array, logp: jax.Array) -> jax.Array:
  """Inverse-CDF draw of one token per row, in two levels.

  A block of `_BLOCK` consecutive tokens is drawn by its probability mass
  with u[:, 0], then a token within it by its share of the block's mass
  with u[:, 1]: exact in distribution, with no cumulative sum over the
  vocabulary and two random numbers a row (a Gumbel-max draw needs one per
  token: slower at Qwen's vocabulary on XLA:CPU,
  `benchmarks/decode_parts.py`). The second level draws against the chosen block's
  own mass, so the tokens of a block are told apart at float32's precision
  relative to that block, not to the whole distribution. Tokens of
  probability 0 (and the padding of the last block) are never drawn.

  Args:
    u: [B, 2] uniforms in [0, 1).
    logp: [B, V] normalised log-probabilities (-inf allowed).
  Returns:
    [B] int32 token ids.
  """
  chex.assert_rank([u, logp], 2)
  b, v = logp.shape
  probs = jnp.exp(logp)
  blocks = jnp.pad(probs, ((0, 0), (0, -v % _BLOCK))).reshape(b, -1, _BLOCK)

  def pick(cdf, u):
    """The first index whose cumulative mass exceeds u x the total: an entry
    of nonzero mass, as u < 1 keeps the target below the total (a float
    product u x t with u < 1 never rounds up to t)."""
    return jnp.sum(cdf <= u[:, None] * cdf[:, -1:], axis=-1)

  block = pick(jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1), u[:, 0])
  within = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
  return (block * _BLOCK + pick(jnp.cumsum(within, axis=-1), u[:, 1])).astype(jnp.int32)


def sample(rng: jax.Array, logits: jax.Array, params: SamplingParams,
           policy_temperature: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws one token per row.

  Args:
    rng: a PRNG key.
    logits: [B, V] next-token logits (any float dtype).
    params: per-row controls.
    policy_temperature: the temperature of the policy the trainer trains
      (`LossConfig.temperature`), whatever each row samples at.
  Returns:
    (tokens [B] int32,
     raw_logprobs [B]: log pi(token) under the trainer's policy (logits /
       policy_temperature, no filtering): what the train step recomputes,
     sampled_logprobs [B]: log-prob under the distribution actually sampled
       from (after temperature and top-k/top-p); 0 for greedy rows).
  """
  logits = logits.astype(jnp.float32)
  b = logits.shape[0]
  greedy = params.temperature <= 0
  filters = (params.top_k > 0) | (params.top_p < 1.0)
  raw_logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  policy_logp = raw_logp if policy_temperature == 1.0 else jax.nn.log_softmax(
      logits / policy_temperature, axis=-1)
  u = jax.random.uniform(rng, (b, 2))

  def draw_from(logp):
    tokens = draw(u, logp)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

  def draw_scaled():
    scaled = logits / jnp.where(greedy, 1.0, params.temperature)[:, None]
    # The full-vocabulary sort is only paid when some row filters.
    scaled = jax.lax.cond(jnp.any(filters), _filter, lambda x, *_: x, scaled,
                          params.top_k, params.top_p)
    return draw_from(scaled - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))

  # Each pass over V is paid only when some row needs it: no draw when every
  # row is greedy, no second normaliser when every row samples the policy
  # itself (temperature 1, no filter), no argmax when no row is greedy.
  drawn, sampled = jax.lax.cond(
      jnp.all(greedy), lambda: (jnp.zeros(b, jnp.int32), jnp.zeros(b)),
      lambda: jax.lax.cond(jnp.all((params.temperature == 1.0) & ~filters),
                           lambda: draw_from(raw_logp), draw_scaled))
  best = jax.lax.cond(jnp.any(greedy), lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
                      lambda: jnp.zeros(b, jnp.int32))
  tokens = jnp.where(greedy, best, drawn)
  raw = jnp.take_along_axis(policy_logp, tokens[:, None], axis=-1)[:, 0]
  return tokens, raw, jnp.where(greedy, 0.0, sampled)
