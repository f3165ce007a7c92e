"""Tests for agentrl_jax.masked against numpy on the selected entries."""

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax import masked


def test_masked_reductions_match_numpy():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 9)).astype(np.float32)
  m = (rng.uniform(size=(4, 9)) < 0.5).astype(np.float32)
  m[1] = 0.0
  sel = x[m > 0]
  np.testing.assert_allclose(masked.masked_sum(x, m), sel.sum(), rtol=1e-5)
  np.testing.assert_allclose(masked.masked_mean(x, m), sel.mean(), rtol=1e-5)
  np.testing.assert_allclose(masked.masked_var(x, m), sel.var(), rtol=1e-5)
  rows = masked.masked_mean(x, m, axis=-1)
  for i in range(4):
    want = x[i][m[i] > 0].mean() if m[i].any() else 0.0
    np.testing.assert_allclose(rows[i], want, rtol=1e-5)
  white = np.asarray(masked.masked_whiten(x, m))
  np.testing.assert_allclose(white[m > 0], (sel - sel.mean()) / (sel.std() + 1e-8),
                             rtol=1e-4)
  assert np.all(white[m == 0] == 0)
  # shift_mean=False keeps the location (veRL's and TRL's meaning).
  scaled = np.asarray(masked.masked_whiten(x, m, shift_mean=False))
  np.testing.assert_allclose(scaled[m > 0], (sel - sel.mean()) / (sel.std() + 1e-8)
                             + sel.mean(), rtol=1e-4)
  np.testing.assert_allclose(scaled[m > 0].mean(), sel.mean(), rtol=1e-4)


def test_empty_mask_is_zero_not_nan():
  x = jnp.array([[1.0, jnp.nan, jnp.inf]])
  m = jnp.zeros((1, 3))
  for fn in (masked.masked_sum, masked.masked_mean, masked.masked_var):
    assert float(fn(x, m)) == 0.0
  assert np.all(np.asarray(masked.masked_whiten(x, m)) == 0)
  g = jax.grad(lambda x: masked.masked_mean(x, m))(jnp.ones((1, 3)))
  assert np.all(np.asarray(g) == 0)
  # NaN/inf outside the mask never leak into the result.
  assert float(masked.masked_mean(x, jnp.array([[1.0, 0.0, 0.0]]))) == 1.0
