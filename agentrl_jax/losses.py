"""Token-level RL losses: log-probs, clipped surrogate, aggregation, KL, entropy.

Pure, jittable functions over [B, L] arrays aligned with the tokens
(docs/design.md, convention 1): position i describes token i, so a loss mask from
`trajectory.collate` is used as is and never shifted by hand. The forward
pass lives in the train step, not here.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "LOSS_AGG_MODES", "KL_KINDS", "LOSS_KL_KINDS", "KL_GRADIENT", "kl_metric_name",
    "token_logprobs", "action_positions", "action_bucket",
    "most_actions",
    "head_logprobs", "token_accuracy", "entropy", "policy_loss",
    "aggregate_loss", "aggregation_weights", "weighted_sum", "kl_penalty", "masked_mean", "masked_sum", "masked_var",
    "masked_whiten",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "k1+", "k3+")
# Under sampling from pi, the divergence whose gradient each kind's term
# follows in expectation (its gradient flows through log pi only): "reverse"
# is KL(pi || pi_ref), "forward" KL(pi_ref || pi); k1's is exactly 0.
KL_GRADIENT = {"k1": None, "k2": "reverse", "k3": "forward", "k1+": "reverse",
               "k3+": "reverse"}
# The kinds a loss term may use: k1's gradient regularises nothing.
LOSS_KL_KINDS = tuple(k for k in KL_KINDS if KL_GRADIENT[k] is not None)
# exp() of a log-ratio beyond this is inf in float32's neighbourhood; such a
# ratio is far outside any clip range, so clamping changes no useful gradient.
_MAX_LOG_RATIO = 20.0


def _shift_right(x: jax.Array) -> jax.Array:
  """[B, L] -> [B, L] with x[:, i - 1] at i and 0 at position 0."""
  return jnp.pad(x[:, :-1], ((0, 0), (1, 0)))


def _next_tokens(tokens: jax.Array) -> jax.Array:
  """[B, L] -> [B, L] with tokens[:, i + 1] at i (the target logits[:, i] predict)."""
  return jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log p(tokens[:, i] | tokens[:, :i]) at position i; position 0 gets 0.

  The logits at position i - 1 predict token i; this function does that
  shift once so that its output is aligned with `tokens` and every mask.
  The log-softmax runs in float32 whatever the logits dtype: bf16 logsumexp
  over a 150k vocabulary loses several bits. Only the [B, L] target logit
  and logsumexp are formed; the float32 cast fuses into the reduction under
  jit rather than materialising a second [B, L, V] array.

  Args:
    logits: [B, L, V] next-token logits, logits[:, i] predicts tokens[:, i+1].
    tokens: [B, L] int token ids.
  Returns:
    [B, L] float32 log-probs aligned with tokens.
  """
  chex.assert_rank([logits, tokens], [3, 2])
  chex.assert_equal_shape_prefix([logits, tokens], 2)
  chex.assert_type([logits, tokens], [float, int])
  target = jnp.take_along_axis(logits, _next_tokens(tokens)[..., None], axis=-1)[..., 0]
  lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return _shift_right(target.astype(jnp.float32) - lse)


def action_positions(loss_mask: jax.Array, num_actions: int
                     ) -> tuple[jax.Array, jax.Array]:
  """Where each row's action tokens are, in order, in a static [B, A] bucket.

  Args:
    loss_mask: [B, L], > 0 on the tokens to train.
    num_actions: A, at least the most such tokens in any row
      (`action_bucket`).
  Returns:
    (index [B, A] int32 position of the row's k-th action token, 0 past the
    last; valid [B, A] bool).
  """
  chex.assert_rank(loss_mask, 2)
  index = jax.vmap(lambda m: jnp.nonzero(m > 0, size=num_actions, fill_value=-1)[0])(
      loss_mask)
  return jnp.maximum(index, 0).astype(jnp.int32), index >= 0


def action_bucket(most_actions: int, length: int, minimum: int = 16) -> int:
  """A for `action_positions`: the most action tokens in a row, rounded up to
  a power of two (so few sizes compile), at least `minimum`, at most the row
  `length`."""
  return min(max(minimum, 1 << max(most_actions - 1, 0).bit_length()), length)


def most_actions(loss_mask) -> int:
  """The most action tokens in a row of a host [B, L] mask."""
  return int(np.asarray(loss_mask > 0).sum(axis=-1).max(initial=0))


def head_logprobs(head: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                  targets: jax.Array, *, chunk: int = 1024, entropy: bool = False,
                  accuracy: bool = False, temperature: float = 1.0) -> dict[str, jax.Array]:
  """log p(target), and optionally the entropy and argmax hit, from hidden states.

  The vocabulary-sized logits exist `chunk` positions at a time, in float32,
  forward and backward (the backward pass recomputes each chunk's logits),
  so peak memory grows with [chunk, V], not with [positions, V]. Callers
  gather the states that predict action tokens first (`action_positions`):
  no head runs where no loss is.

  Args:
    head: [n, d] -> [n, V] logits (e.g. `Decoder.logits`).
    hidden: [..., d] states; each predicts the token at the same index of
      `targets`.
    targets: [...] int token ids.
    chunk: positions per chunk.
    temperature: the policy is softmax(logits / temperature).
  Returns:
    {"logprobs": [...] float32, plus "entropy" and "accuracy" (1.0 where
    the argmax is the target) when asked}, of that policy.
  """
  chex.assert_equal_shape_prefix([hidden, targets], targets.ndim)
  shape, width = targets.shape, hidden.shape[-1]
  h, t = hidden.reshape(-1, width), targets.reshape(-1)
  n = t.shape[0]
  size = max(min(chunk, n), 1)
  pad = -n % size
  h, t = jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(t, (0, pad))

  @jax.checkpoint
  def one(args):
    h_chunk, t_chunk = args
    logits = head(h_chunk).astype(jnp.float32)
    if temperature != 1.0:
      logits = logits / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, t_chunk[:, None], axis=-1)[:, 0]
    out = {"logprobs": target - lse}
    if entropy:  # H = lse - E_p[logit]
      out["entropy"] = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    if accuracy:
      out["accuracy"] = (jnp.argmax(logits, axis=-1) == t_chunk).astype(jnp.float32)
    return out

  out = jax.lax.map(one, (h.reshape(-1, size, width), t.reshape(-1, size)))
  return {k: v.reshape(-1)[:n].reshape(shape) for k, v in out.items()}


def token_accuracy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """[B, L] float32, 1 where argmax logits[:, i - 1] == tokens[:, i]; aligned
  like `token_logprobs` (position 0 gets 0), so masks apply unshifted."""
  chex.assert_rank([logits, tokens], [3, 2])
  hit = jnp.argmax(logits, axis=-1) == _next_tokens(tokens)
  return _shift_right(hit.astype(jnp.float32))


def entropy(logits: jax.Array) -> jax.Array:
  """Entropy of the distribution over token i, aligned with tokens.

  H[:, i] = H(p(. | tokens[:, :i])), computed from logits[:, i - 1] in
  float32; position 0 gets 0. Aligned like `token_logprobs`, so
  `masked_mean(entropy(logits), loss_mask)` is the entropy at action tokens.

  Args:
    logits: [B, L, V].
  Returns:
    [B, L] float32.
  """
  chex.assert_rank(logits, 3)
  logits = logits.astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return _shift_right(-jnp.sum(jnp.exp(logp) * logp, axis=-1))


def aggregation_weights(loss_mask: jax.Array, mode: str, *,
                        norm_constant: float | None = None,
                        seq_ids: jax.Array | None = None) -> jax.Array:
  """Per-token weights w with `aggregate_loss(x, loss_mask, mode) = sum_i w_i x_i`.

  With m the loss mask, S the set of the batch's sequences, n_s the
  action-token count of sequence s and C the constant:

  - "token-mean": w_i = m_i / sum_j m_j. Every action token weighs the same,
    so long trajectories weigh more (DAPO, Yu et al. 2025; veRL's default).
  - "seq-mean-token-mean": w_i = m_i / (|S| n_s). Every trajectory weighs
    the same whatever its length (original GRPO, Shao et al. 2024; the
    reference text's "safe default").
  - "seq-mean-token-sum": w_i = m_i / |S|.
  - "seq-mean-token-sum-norm": w_i = m_i / (|S| C) with a fixed constant C
    (Dr.GRPO, Liu et al. 2025), default C = L, the padded row length. L
    changes with the length bucket, so pass a fixed `norm_constant` (e.g.
    the token budget) to keep the loss scale constant.

  A sequence is a row, or with `seq_ids` every token of one seq id (packed
  rows; the views of a sliding-window trajectory, which share a seq id, are
  one sequence); padding (seq id -1) is none. |S| counts the sequences with
  no action token too (an episode `mask_truncated` zeroed, one with no
  turn): they add 0 rather than re-weighting the others, so the scale of
  the loss does not follow how many were masked (TRL divides by every row
  as well). Weights computed on a whole batch make gradient accumulation
  exact: summing `w * x` over any split of the rows into micro-batches gives
  the full-batch loss (`train.step`).

  Args:
    loss_mask: [B, L] 1 on action tokens.
    mode: one of LOSS_AGG_MODES.
    norm_constant: C for "seq-mean-token-sum-norm".
    seq_ids: [B, L] trajectory id of each token (-1 on padding, which never
      counts), or None: each row is one sequence (padding rows included).
  Returns:
    [B, L] float32 weights, 0 off the mask; all 0 for an all-zero mask.
  """
  if mode not in LOSS_AGG_MODES:
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {LOSS_AGG_MODES}")
  chex.assert_rank(loss_mask, 2)
  mask = loss_mask.astype(jnp.float32)
  if seq_ids is not None:
    chex.assert_equal_shape([loss_mask, seq_ids])
    mask = jnp.where(seq_ids >= 0, mask, 0.0)
  if mode == "token-mean":
    return mask / jnp.maximum(jnp.sum(mask), 1.0)
  if seq_ids is None:
    n_s = jnp.broadcast_to(jnp.sum(mask, axis=-1, keepdims=True), mask.shape)
    num_seqs = mask.shape[0]
  else:
    # At most B * L distinct ids: that bound keeps the shape static.
    ids = jnp.where(seq_ids >= 0, seq_ids, 0).reshape(-1)
    segment_sum = lambda x: jax.ops.segment_sum(x.reshape(-1), ids, num_segments=ids.size)
    n_s = segment_sum(mask)[ids].reshape(mask.shape)
    num_seqs = jnp.sum(segment_sum((seq_ids >= 0).astype(jnp.float32)) > 0)
  per_seq = mask / jnp.maximum(num_seqs, 1).astype(jnp.float32)
  if mode == "seq-mean-token-mean":
    return per_seq / jnp.maximum(n_s, 1.0)
  if mode == "seq-mean-token-sum":
    return per_seq
  return per_seq / (mask.shape[-1] if norm_constant is None else norm_constant)


def weighted_sum(per_token: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_i w_i x_i over the tokens with w_i > 0 (inf/NaN elsewhere never leak)."""
  return masked_sum(per_token.astype(jnp.float32), weights)


def aggregate_loss(per_token: jax.Array, loss_mask: jax.Array, mode: str, *,
                   norm_constant: float | None = None,
                   seq_ids: jax.Array | None = None) -> jax.Array:
  """Reduces a per-token loss to a scalar over the action tokens.

  `sum_i w_i x_i` with the weights of `aggregation_weights` (which lists the
  modes and their formulas). An all-zero mask gives 0 in every mode, with a
  zero (not NaN) gradient.

  Args:
    per_token: [B, L] loss per token, aligned with tokens.
    loss_mask: [B, L] 1 on action tokens.
    mode: one of LOSS_AGG_MODES.
    norm_constant: C for "seq-mean-token-sum-norm".
    seq_ids: [B, L] trajectory id of each token (`TokenBatch.seq_ids`) for
      packed rows; None means each row is one sequence.
  Returns:
    scalar float32.
  """
  chex.assert_rank([per_token, loss_mask], 2)
  chex.assert_equal_shape([per_token, loss_mask])
  return weighted_sum(per_token, aggregation_weights(
      loss_mask, mode, norm_constant=norm_constant, seq_ids=seq_ids))


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array,
                advantages: jax.Array, loss_mask: jax.Array, *,
                clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip: float | None = None, agg: str = "token-mean",
                is_weights: jax.Array | None = None,
                norm_constant: float | None = None,
                seq_ids: jax.Array | None = None,
                token_weights: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO/GRPO clipped surrogate over action tokens.

  Per token, with rho = exp(logp - old_logp):
    l = -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A)
  (Schulman et al. 2017; asymmetric "clip-higher" bounds from DAPO). With
  `dual_clip = c > 1`, tokens with A < 0 are further bounded by l <= -c A
  (Ye et al. 2020), so a huge ratio on a bad action cannot blow up; off by
  default (veRL always applies it, c = 3: `clip_ratio_c`). Optional
  `is_weights` multiply l per token (treated as constants), e.g. truncated
  importance weights correcting the sampler-vs-trainer mismatch. Then
  `aggregate_loss(l, loss_mask, agg)`, or `sum(token_weights * l)` with
  weights from `aggregation_weights` computed on a larger batch (exact
  gradient accumulation over micro-batches).

  Args:
    logprobs: [B, L] log pi_theta(token_i | tokens_<i), aligned with tokens.
    old_logprobs: [B, L] behaviour log-probs recorded at rollout.
    advantages: [B, L] per-token advantages (0 off-action).
    loss_mask: [B, L] 1 on action tokens.
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    dual_clip: the constant c > 1, or None.
    agg: aggregation mode, see `aggregate_loss`.
    is_weights: [B, L] optional per-token weights.
    norm_constant, seq_ids: passed to `aggregate_loss`.
    token_weights: [B, L] optional aggregation weights; replace agg,
      norm_constant and seq_ids.
  Returns:
    (loss scalar, metrics) with metrics token-means over action tokens:
    clip_frac_upper / clip_frac_lower (fraction where the upper / lower clip
    binds and zeroes the gradient), dual_clip_frac, approx_kl (k3 estimate of
    KL(old || new)), ratio_mean, ratio_max.
  """
  chex.assert_rank([logprobs, old_logprobs, advantages, loss_mask], 2)
  chex.assert_equal_shape([logprobs, old_logprobs, advantages, loss_mask])
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
  mask = loss_mask.astype(jnp.float32)
  adv = advantages.astype(jnp.float32)
  # Off-action positions get log-ratio 0: their old_logprobs are 0 by
  # convention, and exp(logp - 0) must not produce inf * 0 = NaN there.
  log_ratio = jnp.where(mask > 0, logprobs.astype(jnp.float32)
                        - old_logprobs.astype(jnp.float32), 0.0)
  log_ratio = jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  per_token = jnp.maximum(-ratio * adv, -clipped_ratio * adv)
  if dual_clip is not None:
    per_token = jnp.where(adv < 0, jnp.minimum(per_token, -dual_clip * adv),
                          per_token)
  if is_weights is not None:
    chex.assert_equal_shape([is_weights, logprobs])
    per_token = per_token * jax.lax.stop_gradient(is_weights)
  if token_weights is None:
    loss = aggregate_loss(per_token, mask, agg, norm_constant=norm_constant,
                          seq_ids=seq_ids)
  else:
    chex.assert_equal_shape([token_weights, logprobs])
    loss = weighted_sum(per_token, token_weights)

  ratio, log_ratio = jax.lax.stop_gradient((ratio, log_ratio))
  upper = (ratio > 1.0 + clip_high) & (adv > 0)
  lower = (ratio < 1.0 - clip_low) & (adv < 0)
  dual = ((adv < 0) & (ratio > dual_clip) if dual_clip is not None
          else jnp.zeros_like(upper))
  metrics = {
      "clip_frac_upper": masked_mean(upper.astype(jnp.float32), mask),
      "clip_frac_lower": masked_mean(lower.astype(jnp.float32), mask),
      "dual_clip_frac": masked_mean(dual.astype(jnp.float32), mask),
      # k3 with samples from the old policy: r - 1 - log r >= 0.
      "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
      "ratio_mean": masked_mean(ratio, mask),
      "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),
  }
  return loss, metrics


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array,
               kind: str = "k3") -> jax.Array:
  """Per-token KL terms at tokens sampled from pi_theta.

  With d = ref_logprobs - logprobs = log(pi_ref / pi_theta) (Schulman,
  "Approximating KL divergence", 2020), the values and, as a loss term
  whose gradient flows through log pi_theta, the expected gradient
  (`KL_GRADIENT`; Shah et al. 2025, "A Comedy of Estimators"):
    k1 = -d              value: unbiased KL(pi || ref); gradient 0 in expectation
    k2 = d^2 / 2         value: biased, >= 0; gradient of KL(pi || ref)
    k3 = exp(d) - d - 1  value: unbiased KL(pi || ref), >= 0 (GRPO's choice);
                         gradient of KL(ref || pi), the forward KL
    k1+, k3+             straight-through (veRL's): the value of k1 / k3, the
                         gradient of k2, so KL(pi || ref)'s
  d is clamped to +-20 before exp, as veRL does, to keep k3 finite.

  Args:
    logprobs: [B, L] current policy log-probs aligned with tokens.
    ref_logprobs: [B, L] reference policy log-probs, same alignment.
    kind: one of KL_KINDS.
  Returns:
    [B, L] float32; mask and aggregate it like any per-token loss.
  """
  if kind not in KL_KINDS:
    raise ValueError(f"unknown KL estimator {kind!r}; known: {KL_KINDS}")
  chex.assert_equal_shape([logprobs, ref_logprobs])
  d = ref_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)
  if kind.endswith("+"):
    value, grad = kl_penalty(logprobs, ref_logprobs, kind[:-1]), 0.5 * jnp.square(d)
    return jax.lax.stop_gradient(value - grad) + grad
  if kind == "k1":
    return -d
  if kind == "k2":
    return 0.5 * jnp.square(d)
  d = jnp.clip(d, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  return jnp.exp(d) - d - 1.0


def kl_metric_name(kind: str) -> str:
  """The logged name of a loss's KL term of `kind`: the kind and the
  divergence its gradient follows, e.g. "kl_k3_grad_forward"."""
  if KL_GRADIENT.get(kind) is None:
    raise ValueError(f"{kind!r} is no loss term's KL kind; known: {LOSS_KL_KINDS}")
  return f"kl_{kind}_grad_{KL_GRADIENT[kind]}"
