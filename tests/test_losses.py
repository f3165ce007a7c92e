"""Tests for agentrl_jax.losses against hand counts and plain loops."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import losses, train
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate


# -- Plain-Python references ----------------------------------------------------------

def ref_log_softmax(z):
  z = np.asarray(z, np.float64)
  m = z.max()
  return z - m - np.log(np.exp(z - m).sum())


def ref_token_logprobs(logits, tokens):
  b, l, _ = logits.shape
  out = np.zeros((b, l))
  for i in range(b):
    for j in range(1, l):
      out[i, j] = ref_log_softmax(logits[i, j - 1])[tokens[i, j]]
  return out


def ref_aggregate(x, m, mode, c=None, seqs=None):
  b, l = x.shape
  seqs = np.repeat(np.arange(b)[:, None], l, 1) if seqs is None else seqs
  if mode == "token-mean":
    return (x * m).sum() / m.sum() if m.sum() else 0.0
  per = []
  for s in np.unique(seqs[seqs >= 0]):
    sel = (seqs == s) & (m > 0)
    total = x[sel].sum()
    per.append({"seq-mean-token-mean": total / max(sel.sum(), 1),
                "seq-mean-token-sum": total,
                "seq-mean-token-sum-norm": total / (l if c is None else c)}[mode])
  return float(np.mean(per)) if per else 0.0


def ref_ppo_token(lp, old, a, cl, ch, dual):
  ratio = np.exp(lp - old)
  loss = max(-ratio * a, -min(max(ratio, 1 - cl), 1 + ch) * a)
  if dual is not None and a < 0:
    loss = min(loss, -dual * a)
  return loss


def _random_batch(rng, b=4, l=12):
  lp = -rng.uniform(0.05, 3.0, (b, l)).astype(np.float32)
  old = (lp + rng.normal(0, 0.4, (b, l))).astype(np.float32)
  old = np.minimum(old, 0.0)
  a = rng.normal(size=(b, l)).astype(np.float32)
  m = (rng.uniform(size=(b, l)) < 0.6).astype(np.float32)
  m[:, 0] = 0.0
  return lp, old, a, m


# -- token_logprobs / entropy -------------------------------------------------------------

def test_token_logprobs_matches_loop_and_is_aligned():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 9, 17)).astype(np.float32) * 3
  tokens = rng.integers(0, 17, (3, 9))
  got = losses.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens))
  assert got.dtype == jnp.float32 and got.shape == (3, 9)
  np.testing.assert_allclose(got, ref_token_logprobs(logits, tokens), atol=1e-5)
  assert np.all(np.asarray(got)[:, 0] == 0)


def test_token_logprobs_in_float32_for_bf16_logits():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(2, 6, 3000)) * 8, jnp.bfloat16)
  tokens = jnp.asarray(rng.integers(0, 3000, (2, 6)))
  got = jax.jit(losses.token_logprobs)(logits, tokens)
  assert got.dtype == jnp.float32
  # Exactly the float32 computation on the same (bf16-valued) logits; a bf16
  # logsumexp over 3000 entries would be off by ~1e-2.
  want = ref_token_logprobs(np.asarray(logits.astype(jnp.float32)), np.asarray(tokens))
  np.testing.assert_allclose(got, want, atol=1e-4)


def test_entropy_matches_loop():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  got = np.asarray(losses.entropy(jnp.asarray(logits)))
  for i in range(2):
    assert got[i, 0] == 0
    for j in range(1, 5):
      p = np.exp(ref_log_softmax(logits[i, j - 1]))
      np.testing.assert_allclose(got[i, j], -(p * np.log(p)).sum(), rtol=1e-5)
  # Uniform logits: entropy log V.
  np.testing.assert_allclose(losses.entropy(jnp.zeros((1, 2, 7)))[0, 1], np.log(7),
                             rtol=1e-6)


# -- aggregate_loss ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_aggregate_matches_loop(mode):
  rng = np.random.default_rng(3)
  x = rng.normal(size=(5, 8)).astype(np.float32)
  m = (rng.uniform(size=(5, 8)) < 0.5).astype(np.float32)
  m[2] = 0.0  # a sequence with no action tokens counts, adding 0
  np.testing.assert_allclose(losses.aggregate_loss(x, m, mode),
                             ref_aggregate(x, m, mode), rtol=1e-5)
  np.testing.assert_allclose(losses.aggregate_loss(x, m, mode, norm_constant=3.0),
                             ref_aggregate(x, m, mode, c=3.0), rtol=1e-5)
  seqs = rng.integers(-1, 9, (5, 8))  # packed: several ids per row, -1 = pad
  np.testing.assert_allclose(
      losses.aggregate_loss(x, m, mode, seq_ids=jnp.asarray(seqs)),
      ref_aggregate(x, m * (seqs >= 0), mode, seqs=seqs), rtol=1e-5)


def test_sequences_without_action_tokens_count_in_the_seq_mean_modes():
  # Seq 0: actions 1, 3 (sum 4, mean 2); seq 1: action 6; seq 2 a real
  # sequence whose loss is masked (mask_truncated); the last row padding.
  # |S| = 3, as TRL divides by every row: the masked one adds 0.
  x = np.array([[1, 3, 100], [6, 100, 100], [100, 100, 100], [100, 100, 100]], np.float32)
  m = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]], np.float32)
  ids = np.array([[0, 0, 0], [1, 1, -1], [2, 2, 2], [-1, -1, -1]], np.int32)
  want = {"token-mean": 10 / 3, "seq-mean-token-mean": (2 + 6 + 0) / 3,
          "seq-mean-token-sum": (4 + 6 + 0) / 3, "seq-mean-token-sum-norm": 10 / 3 / 3}
  for mode, value in want.items():
    np.testing.assert_allclose(losses.aggregate_loss(x, m, mode, seq_ids=ids), value,
                               rtol=1e-6)
    # Weights of the whole batch: any split of its rows adds up to the loss.
    w = np.asarray(losses.aggregation_weights(m, mode, seq_ids=ids))
    split = sum(float(losses.weighted_sum(x[r:r + 2], w[r:r + 2])) for r in (0, 2))
    np.testing.assert_allclose(split, value, rtol=1e-6)
  # Without seq_ids every row is a sequence, the padding one too: 4.
  np.testing.assert_allclose(losses.aggregate_loss(x, m, "seq-mean-token-sum"), 10 / 4,
                             rtol=1e-6)


def test_aggregate_modes_by_hand():
  # Row 0: actions 1, 3 (sum 4, mean 2); row 1: action 6 (sum 6, mean 6).
  x = jnp.array([[1.0, 3.0, 100.0], [6.0, 100.0, 100.0]])
  m = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  agg = lambda mode, **kw: float(losses.aggregate_loss(x, m, mode, **kw))
  assert agg("token-mean") == pytest.approx(10 / 3)  # (1 + 3 + 6) / 3
  assert agg("seq-mean-token-mean") == pytest.approx(4.0)  # (2 + 6) / 2
  assert agg("seq-mean-token-sum") == pytest.approx(5.0)  # (4 + 6) / 2
  assert agg("seq-mean-token-sum-norm") == pytest.approx(5 / 3)  # C = L = 3
  assert agg("seq-mean-token-sum-norm", norm_constant=10.0) == pytest.approx(0.5)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_all_zero_mask_gives_zero_and_finite_grad(mode):
  x = jnp.full((2, 4), jnp.inf).at[0, 0].set(1.0)  # even inf off-mask is ignored
  m = jnp.zeros((2, 4))
  assert float(losses.aggregate_loss(x, m, mode)) == 0.0
  g = jax.grad(lambda x: losses.aggregate_loss(x, m, mode))(jnp.ones((2, 4)))
  assert np.all(np.asarray(g) == 0)
  loss, metrics = losses.policy_loss(jnp.zeros((2, 4)), jnp.zeros((2, 4)),
                                     jnp.ones((2, 4)), m, agg=mode)
  assert float(loss) == 0.0
  assert all(np.isfinite(np.asarray(v)) for v in metrics.values())


def test_unknown_names_list_known_ones():
  with pytest.raises(ValueError, match="known: \\('token-mean'"):
    losses.aggregate_loss(jnp.zeros((1, 2)), jnp.ones((1, 2)), "sum")
  with pytest.raises(ValueError, match=re.escape("known: ('k1', 'k2', 'k3', 'k1+', 'k3+')")):
    losses.kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), "k4")
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    losses.policy_loss(*[jnp.zeros((1, 2))] * 4, dual_clip=0.5)


# -- policy_loss ---------------------------------------------------------------------------

@pytest.mark.parametrize("cl, ch, dual", [(0.2, 0.2, None), (0.2, 0.28, None),
                                          (0.1, 0.3, 3.0)])
@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_policy_loss_matches_loop(cl, ch, dual, mode):
  rng = np.random.default_rng(4)
  lp, old, a, m = _random_batch(rng)
  w = rng.uniform(0.5, 1.5, lp.shape).astype(np.float32)
  per = np.array([[ref_ppo_token(lp[i, j], old[i, j], a[i, j], cl, ch, dual)
                   for j in range(lp.shape[1])] for i in range(lp.shape[0])])
  loss, _ = losses.policy_loss(lp, old, a, m, clip_low=cl, clip_high=ch,
                               dual_clip=dual, agg=mode)
  np.testing.assert_allclose(loss, ref_aggregate(per, m, mode), rtol=1e-5)
  loss, _ = losses.policy_loss(lp, old, a, m, clip_low=cl, clip_high=ch,
                               dual_clip=dual, agg=mode, is_weights=w)
  np.testing.assert_allclose(loss, ref_aggregate(per * w, m, mode), rtol=1e-5)


def test_policy_loss_metrics_by_hand():
  # ratios e^{log r}: 1.5 (A>0: upper clip binds), 0.5 (A<0: lower binds),
  # 1.5 with A<0 (no clip binds; unclipped path), 1.0; the 5th is masked out.
  log_r = np.log([1.5, 0.5, 1.5, 1.0, 50.0])
  lp = jnp.asarray([log_r - 1.0])
  old = jnp.full((1, 5), -1.0)
  a = jnp.array([[1.0, -1.0, -1.0, 2.0, 1.0]])
  m = jnp.array([[1.0, 1.0, 1.0, 1.0, 0.0]])
  loss, met = losses.policy_loss(lp, old, a, m)
  # per token: -min(1.5, 1.2) = -1.2; -min(-.5, -.8) = .8; -min(-1.5, -1.2) = 1.5;
  # -2: mean (-1.2 + .8 + 1.5 - 2) / 4 = -0.225.
  np.testing.assert_allclose(loss, -0.225, rtol=1e-5)
  np.testing.assert_allclose(met["clip_frac_upper"], 0.25)
  np.testing.assert_allclose(met["clip_frac_lower"], 0.25)
  np.testing.assert_allclose(met["ratio_mean"], (1.5 + 0.5 + 1.5 + 1.0) / 4, rtol=1e-6)
  np.testing.assert_allclose(met["ratio_max"], 1.5, rtol=1e-6)
  k3 = np.mean([r - 1 - np.log(r) for r in (1.5, 0.5, 1.5, 1.0)])
  np.testing.assert_allclose(met["approx_kl"], k3, rtol=1e-5)
  # Dual clip c = 1.4 caps the third token's loss at 1.4 * |A| = 1.4.
  loss, met = losses.policy_loss(lp, old, a, m, dual_clip=1.4)
  np.testing.assert_allclose(loss, (-1.2 + 0.8 + 1.4 - 2) / 4, rtol=1e-5)
  np.testing.assert_allclose(met["dual_clip_frac"], 0.25)


def test_gradient_is_zero_exactly_where_the_clip_binds():
  rng = np.random.default_rng(5)
  lp, old, a, m = _random_batch(rng, b=8, l=32)
  m[:] = 1.0
  m[:, 0] = 0.0
  cl, ch = 0.2, 0.28
  g = np.asarray(jax.grad(lambda lp: losses.policy_loss(
      lp, old, a, m, clip_low=cl, clip_high=ch)[0])(jnp.asarray(lp)))
  ratio = np.exp(lp - old)
  outside = ((ratio > 1 + ch) & (a > 0)) | ((ratio < 1 - cl) & (a < 0))
  assert outside.sum() > 10 and (~outside & (m > 0)).sum() > 10
  assert np.all(g[outside] == 0)
  inside = ~outside & (m > 0)
  # Inside, d/dlp of -ratio * A / n = -ratio * A / n.
  np.testing.assert_allclose(g[inside], (-ratio * a / m.sum())[inside], rtol=1e-4)
  assert np.all(g[m == 0] == 0)


def test_off_action_positions_cannot_make_nan():
  # Observation tokens carry old_logprobs 0 and anything as new logprobs.
  lp = jnp.array([[-1.0, 80.0, -200.0]])
  old = jnp.array([[-1.2, 0.0, 0.0]])
  m = jnp.array([[1.0, 0.0, 0.0]])
  loss, met = losses.policy_loss(lp, old, jnp.ones_like(lp), m, dual_clip=3.0)
  g = jax.grad(lambda lp: losses.policy_loss(lp, old, jnp.ones_like(lp), m)[0])(lp)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
  assert all(np.isfinite(np.asarray(v)) for v in met.values())


# -- KL -----------------------------------------------------------------------------------

def test_kl_estimators_match_formulas():
  rng = np.random.default_rng(6)
  lp = -rng.uniform(0, 4, (3, 7))
  ref = -rng.uniform(0, 4, (3, 7))
  d = ref - lp
  np.testing.assert_allclose(losses.kl_penalty(lp, ref, "k1"), lp - ref, rtol=1e-5)
  np.testing.assert_allclose(losses.kl_penalty(lp, ref, "k2"), 0.5 * d ** 2, rtol=1e-5)
  k3 = np.asarray(losses.kl_penalty(lp, ref, "k3"))
  np.testing.assert_allclose(k3, np.exp(d) - d - 1, rtol=1e-4, atol=1e-6)
  assert np.all(k3 >= 0)
  np.testing.assert_allclose(losses.kl_penalty(lp, lp, "k3"), 0.0, atol=0)


def test_k3_is_unbiased_for_the_true_kl():
  # Samples x ~ p of two categoricals: E_p[k3] = KL(p || q) exactly.
  p = np.array([0.5, 0.3, 0.2])
  q = np.array([0.2, 0.2, 0.6])
  kl = (p * np.log(p / q)).sum()
  lp, ref = np.log(p)[None], np.log(q)[None]
  for kind in ("k1", "k3", "k1+", "k3+"):
    est = (p * np.asarray(losses.kl_penalty(lp, ref, kind))[0]).sum()
    np.testing.assert_allclose(est, kl, rtol=1e-5)


@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_each_kl_kinds_expected_gradient_is_its_divergences(kind):
  # A categorical policy pi = softmax(theta) over 6 tokens and a reference;
  # the term's expected gradient by exact enumeration, E_{x ~ pi}[grad
  # k(x)] = sum_x pi(x) grad k(x) (the samples' weights are data: no
  # gradient through them), against the closed forms in float64:
  # grad KL(pi || ref) = pi * (log(pi / ref) - KL(pi || ref)),
  # grad KL(ref || pi) = pi - ref (softmax's Jacobian), and 0 for k1.
  rng = np.random.default_rng(3)
  theta, phi = rng.normal(size=6), rng.normal(size=6)
  log_pi = theta - np.log(np.exp(theta).sum())
  log_ref = phi - np.log(np.exp(phi).sum())
  pi, ref = np.exp(log_pi), np.exp(log_ref)

  def expected(t):
    lp = jax.nn.log_softmax(t)
    weights = jax.lax.stop_gradient(jnp.exp(lp))
    return jnp.sum(weights * losses.kl_penalty(lp[None], jnp.asarray(log_ref)[None], kind)[0])

  got = np.asarray(jax.grad(expected)(jnp.asarray(theta, jnp.float32)), np.float64)
  reverse = pi * (log_pi - log_ref - np.sum(pi * (log_pi - log_ref)))
  want = {None: np.zeros(6), "reverse": reverse, "forward": pi - ref}[losses.KL_GRADIENT[kind]]
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert np.abs(reverse - (pi - ref)).max() > 0.05  # the two directions differ here
  if losses.KL_GRADIENT[kind] is None:
    with pytest.raises(ValueError, match="no loss term's KL kind"):
      losses.kl_metric_name(kind)
  else:
    assert losses.kl_metric_name(kind) == f"kl_{kind}_grad_{losses.KL_GRADIENT[kind]}"


def test_a_loss_refuses_k1():
  with pytest.raises(ValueError, match="k1's expected gradient is 0"):
    train.LossConfig(kl_kind="k1", kl_beta=0.1)
  train.LossConfig(kl_kind="k1+", kl_beta=0.1)


# -- Batches: padding, jit, retracing ----------------------------------------------------------

def _trajs(rng, lengths):
  out = []
  for n in lengths:
    act = list(rng.integers(0, 30, n))
    out.append(Trajectory([Segment(Role.SYSTEM, [1, 2, 3]),
                           Segment(Role.ASSISTANT, act, list(-rng.uniform(0, 2, n)))],
                          reward=float(rng.uniform())))
  return out


def _batch_loss(logits, batch, agg):
  logp = losses.token_logprobs(logits, batch.tokens)
  kl = losses.kl_penalty(logp, logp - 0.1, "k3")
  kw = dict(norm_constant=16.0, seq_ids=batch.seq_ids)  # padding rows never count
  pg, metrics = losses.policy_loss(logp, batch.old_logprobs, batch.loss_mask,
                                   batch.loss_mask, agg=agg, **kw)
  return pg + 0.1 * losses.aggregate_loss(kl, batch.loss_mask, agg, **kw), metrics


@pytest.mark.parametrize("agg", losses.LOSS_AGG_MODES)
def test_padding_does_not_change_the_loss(agg):
  rng = np.random.default_rng(7)
  trajs = _trajs(rng, [4, 9, 2])
  small = collate(trajs, buckets=(12,))
  big = collate(trajs, buckets=(40,), num_rows=5)
  logits = rng.normal(size=(5, 40, 30)).astype(np.float32)
  # Same logits on the real tokens; padding logits are garbage.
  l_small = _batch_loss(jnp.asarray(logits[:3, :12]), small, agg)[0]
  l_big = _batch_loss(jnp.asarray(logits * 1.0), big, agg)[0]
  np.testing.assert_allclose(l_small, l_big, rtol=1e-5)


def test_jit_matches_eager_and_no_retrace_within_a_bucket():
  rng = np.random.default_rng(8)
  logits = jnp.asarray(rng.normal(size=(3, 16, 30)).astype(np.float32))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(logits, batch):
    return _batch_loss(logits, batch, "seq-mean-token-mean")

  chex.clear_trace_counter()
  first = collate(_trajs(rng, [4, 9, 2]), buckets=(16, 32))
  second = collate(_trajs(rng, [12, 1, 7]), buckets=(16, 32))  # same bucket
  assert first.tokens.shape == second.tokens.shape == (3, 16)
  for batch in (first, second):
    jitted = step(logits, batch)
    eager = _batch_loss(logits, batch, "seq-mean-token-mean")
    chex.assert_trees_all_close(jitted, eager, rtol=1e-5)


def test_action_positions_and_bucket_by_hand():
  mask = np.array([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 1]], np.float32)
  index, valid = losses.action_positions(mask, 4)
  np.testing.assert_array_equal(index, [[1, 2, 4, 0], [0, 0, 0, 0], [0, 4, 0, 0]])
  np.testing.assert_array_equal(valid, [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
  assert losses.most_actions(mask) == 3 and losses.most_actions(mask[1:2]) == 0
  assert losses.action_bucket(3, 5, minimum=1) == 4  # the next power of two
  assert losses.action_bucket(3, 5) == 5  # at least 16, but at most L
  assert losses.action_bucket(300, 300) == 300 and losses.action_bucket(33, 33) == 33
  assert losses.action_bucket(17, 117) == 32 and losses.action_bucket(0, 117) == 16


@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
def test_head_logprobs_equal_the_full_logits_and_their_gradients(chunk):
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(3, 7, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 50, size=(3, 7)), jnp.int32)

  def chunked(w, hidden):
    out = losses.head_logprobs(lambda h: h @ w, hidden, targets, chunk=chunk,
                               entropy=True, accuracy=True)
    return out["logprobs"].sum() + 0.3 * out["entropy"].sum(), out

  def full(w, hidden):
    # The same quantities through token_logprobs / entropy / token_accuracy:
    # logits at i - 1 predict token i, so shift the targets right by one.
    logits = jnp.pad(hidden @ w, ((0, 0), (0, 1), (0, 0)))
    tokens = jnp.pad(targets, ((0, 0), (1, 0)))
    lp = losses.token_logprobs(logits, tokens)[:, 1:]
    ent = losses.entropy(logits)[:, 1:]
    acc = losses.token_accuracy(logits, tokens)[:, 1:]
    return lp.sum() + 0.3 * ent.sum(), {"logprobs": lp, "entropy": ent, "accuracy": acc}

  (got, got_out), got_grads = jax.value_and_grad(chunked, (0, 1), has_aux=True)(w, hidden)
  (want, want_out), want_grads = jax.value_and_grad(full, (0, 1), has_aux=True)(w, hidden)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for key in want_out:
    np.testing.assert_allclose(got_out[key], want_out[key], rtol=1e-5, atol=1e-6)
  for g, h in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6)


def test_head_logprobs_at_a_temperature_against_float64():
  rng = np.random.default_rng(1)
  hidden, w = rng.normal(size=(4, 8)), rng.normal(size=(8, 50))
  targets = rng.integers(0, 50, size=4)
  out = losses.head_logprobs(lambda h: h @ jnp.asarray(w, jnp.float32),
                             jnp.asarray(hidden, jnp.float32), jnp.asarray(targets),
                             chunk=3, entropy=True, temperature=1.7)
  z = hidden @ w / 1.7
  logp = z - z.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  np.testing.assert_allclose(out["logprobs"], logp[np.arange(4), targets], rtol=1e-5)
  np.testing.assert_allclose(out["entropy"], -(np.exp(logp) * logp).sum(-1), rtol=1e-5)


def test_head_logprobs_never_holds_more_than_a_chunk_of_logits():
  # The gradient's temporaries grow with the chunk, not with the positions:
  # 2048 or 8192 positions over a 32k vocabulary (256 / 1024 MiB of float32
  # logits at once) take the same few [chunk, V] buffers.
  d, v = 16, 32768

  def temp_bytes(n, chunk):
    hidden = jnp.zeros((n, d), jnp.float32)
    targets = jnp.zeros((n,), jnp.int32)
    loss = lambda w: losses.head_logprobs(lambda h: h @ w, hidden, targets, chunk=chunk,
                                          entropy=True)["entropy"].sum()
    w = jnp.zeros((d, v), jnp.float32)
    return jax.jit(jax.grad(loss)).lower(w).compile().memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(2048, 128), temp_bytes(8192, 128)
  assert large < 1.1 * small < 2048 * v * 4 / 2, (small, large)
  assert temp_bytes(8192, 256) > 1.5 * large  # and it is the chunk that sets it
