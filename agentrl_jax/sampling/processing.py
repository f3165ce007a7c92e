"""Per-slot sampling controls: temperature, top-k, top-p, greedy.

All controls are [B] arrays, so changing them between calls never
recompiles. Every function runs in float32.
"""

from __future__ import annotations

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
  """Masks (to -inf) tokens outside each row's top-k and top-p nucleus."""
  vocab = logits.shape[-1]
  sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
  # Nucleus: keep the smallest prefix of the sorted distribution whose mass
  # reaches top_p (the token that crosses it is kept).
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
  pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
  threshold = jnp.maximum(kth, pth)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(rng: jax.Array, logits: jax.Array, params: SamplingParams
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws one token per row.

  Args:
    rng: a PRNG key.
    logits: [B, V] next-token logits (any float dtype).
    params: per-row controls.
  Returns:
    (tokens [B] int32,
     raw_logprobs [B]: log pi(token) under the policy itself (temperature 1,
       no filtering): what `losses.token_logprobs` recomputes in training,
     sampled_logprobs [B]: log-prob under the distribution actually sampled
       from (after temperature and top-k/top-p); 0 for greedy rows).
  """
  logits = logits.astype(jnp.float32)
  greedy = params.temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, params.temperature)[:, None]
  filters = (params.top_k > 0) | (params.top_p < 1.0)
  # The full-vocabulary sort is only paid when some row filters.
  scaled = jax.lax.cond(jnp.any(filters), _filter, lambda x, *_: x, scaled,
                        params.top_k, params.top_p)
  drawn = jax.random.categorical(rng, scaled, axis=-1)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  pick = lambda x: jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]
  raw = pick(logits) - jax.nn.logsumexp(logits, axis=-1)
  # When every row samples the policy itself (temperature 1, no filter) the
  # sampled distribution is the raw one: no second normaliser over V.
  sampled = jax.lax.cond(
      jnp.all((params.temperature == 1.0) & ~filters), lambda: raw,
      lambda: jnp.where(greedy, 0.0, pick(scaled) - jax.nn.logsumexp(scaled, axis=-1)))
  return tokens, raw, sampled
