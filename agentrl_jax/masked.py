"""Masked reductions shared by the losses and the advantage estimators.

Every function treats `mask` as 0/1 weights broadcastable to `x`. An
all-zero mask gives 0 (never 0/0 = NaN), and its gradient is 0 as well.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """sum(x * mask) over `axis`; masked entries never contribute (even inf/NaN)."""
  return jnp.sum(jnp.where(mask > 0, x * mask, 0.0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """sum(x * mask) / sum(mask) over `axis`, and 0 where sum(mask) == 0."""
  mask = jnp.broadcast_to(mask, x.shape).astype(jnp.float32)
  total = masked_sum(x, mask, axis)
  count = jnp.sum(mask, axis=axis)
  return jnp.where(count > 0, total / jnp.maximum(count, 1e-8), 0.0)


def masked_var(x: jax.Array, mask: jax.Array, axis=None, *,
               unbiased: bool = False) -> jax.Array:
  """Variance of the masked entries, two-pass (the mean first): population
  (/ n), or with `unbiased` Bessel's / (n - 1), the default of veRL's and
  TRL's `masked_var`. 0 where nothing is masked in; 0 for one entry (veRL
  raises there)."""
  mean = masked_mean(x, mask, axis)
  mean = mean if axis is None else jnp.expand_dims(mean, axis)
  var = masked_mean(jnp.square(x - mean), mask, axis)
  if not unbiased:
    return var
  n = jnp.sum(jnp.broadcast_to(mask, x.shape).astype(jnp.float32), axis=axis)
  return var * n / jnp.maximum(n - 1, 1.0)


def masked_whiten(x: jax.Array, mask: jax.Array, *, shift_mean: bool = True,
                  eps: float = 1e-8) -> jax.Array:
  """(x - mean) / (std + eps) with mean/std over the masked entries only.

  shift_mean=False adds the mean back after whitening, (x - mean) / (std +
  eps) + mean: the scale is normalised, the location kept. That is what the
  name means in veRL (`verl.utils.torch_functional.masked_whiten`) and TRL
  (`trl.trainer.utils.masked_whiten`). Masked-out entries come back as 0.
  """
  mean = masked_mean(x, mask)
  std = jnp.sqrt(masked_var(x, mask))
  white = (x - mean) / (std + eps)
  if not shift_mean:
    white = white + mean
  return jnp.where(mask > 0, white, 0.0)
