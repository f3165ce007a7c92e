"""The jitted RL and SFT steps: exact accumulation, reference gradients, guards."""

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentrl_jax import checkpointing, losses, models, train, trajectory
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate


def _batch(seed=0, n=8, vocab=64, pack=False, buckets=(48,)):
  rng = np.random.default_rng(seed)
  trajs = []
  for i in range(n):
    segs = [Segment(Role.SYSTEM, rng.integers(0, vocab, 5))]
    for _ in range(i % 3 + 1):
      a = rng.integers(0, vocab, int(rng.integers(2, 6)))
      segs += [Segment(Role.ASSISTANT, a, -rng.uniform(3, 5, len(a))),
               Segment(Role.OBSERVATION, rng.integers(0, vocab, 3))]
    trajs.append(Trajectory(segs, reward=1.0))
  batch = collate(trajs, buckets=buckets, pack=pack)
  adv = batch.loss_mask * rng.normal(size=batch.loss_mask.shape).astype(np.float32)
  return batch.replace(advantages=adv)


@pytest.fixture(scope="module")
def model():
  return models.Decoder(models.tiny_config("qwen2", vocab_size=64), rngs=nnx.Rngs(0))


def _logprobs(model, batch):
  return np.asarray(losses.token_logprobs(model(batch.tokens, batch.positions, batch.seq_ids),
                                          batch.tokens))


def _exact_sampler(model, batch):
  """`batch` with the model's own log-probs as the sampler's (sampling the policy)."""
  lp = np.where(batch.loss_mask > 0, _logprobs(model, batch), 0.0)
  return batch.replace(old_logprobs=lp, sampling_logprobs=lp)


def _run(model, cfg, batch, tx=None, steps=1):
  tx = tx or optax.sgd(1.0)
  graphdef, state = train.init_train_state(model, tx, with_reference=cfg.kl_beta > 0)
  step = train.RLStep(graphdef, tx, cfg)
  for _ in range(steps):
    before = state.params
    before = jax.tree.map(jnp.copy, before)
    state, metrics = step(state, batch)
  return before, state, metrics, step


def _reference_loss(model, batch, cfg, params_ref):
  """The full-batch objective written directly with the losses module."""
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(params):
    m = nnx.merge(graphdef, params)
    logits = m(batch.tokens, batch.positions, batch.seq_ids) / cfg.temperature
    lp = losses.token_logprobs(logits, batch.tokens)
    agg = dict(norm_constant=cfg.norm_constant, seq_ids=batch.seq_ids)
    pg, _ = losses.policy_loss(lp, batch.old_logprobs, batch.advantages,
                               batch.loss_mask, clip_low=cfg.clip_low,
                               clip_high=cfg.clip_high, agg=cfg.agg, **agg)
    ref_lp = losses.token_logprobs(nnx.merge(graphdef, params_ref)(
        batch.tokens, batch.positions, batch.seq_ids) / cfg.temperature, batch.tokens)
    kl = losses.aggregate_loss(losses.kl_penalty(lp, ref_lp, cfg.kl_kind),
                               batch.loss_mask, cfg.agg, **agg)
    ent = losses.aggregate_loss(losses.entropy(logits), batch.loss_mask, cfg.agg, **agg)
    return pg + cfg.kl_beta * kl - cfg.entropy_coef * ent

  return loss, params


def params_of(model):
  return nnx.split(model, nnx.Param)[1]


def test_ppo_epochs_and_loss_decrease(model):
  batch = _batch(1)
  tx = optax.adam(3e-3)
  cfg = train.LossConfig(ppo_epochs=4, clip_low=10.0, clip_high=10.0)  # no clipping
  _, state, metrics, step = _run(model, cfg, batch, tx=tx, steps=3)
  assert int(state.step) == 12 and step.traces == 1
  # On a fixed batch the surrogate keeps dropping (the policy moves along A).
  _, _, m_first, _ = _run(model, cfg, batch, tx=tx)
  assert float(metrics["pg_loss"]) < float(m_first["pg_loss"]) - 0.1


def test_the_last_ppo_epochs_ratio_metrics(model):
  # The step's metrics are the first epoch's (ratios 1 with an exact
  # sampler); the `_last_epoch` ones are the second epoch's, whose ratios
  # compare the once-updated policy with the sampler: float64 from its
  # log-probs.
  batch = _batch(5)
  exact = _exact_sampler(model, batch)
  tx = optax.sgd(3.0)
  _, _, m, _ = _run(model, train.LossConfig(ppo_epochs=2), exact, tx=tx)
  _, one, m_one, _ = _run(model, train.LossConfig(ppo_epochs=1), exact, tx=tx)
  assert not any(k.endswith("_last_epoch") for k in m_one)
  assert float(m["approx_kl"]) < 1e-6 and float(m["clip_frac_upper"]) == 0.0
  graphdef, _ = nnx.split(model, nnx.Param)
  moved = nnx.merge(graphdef, one.params)
  lp1 = _logprobs(moved, batch).astype(np.float64)
  on = batch.loss_mask > 0
  log_r = lp1[on] - exact.old_logprobs[on]
  r, adv = np.exp(log_r), batch.advantages[on]
  want = {"approx_kl": np.mean(r - 1 - log_r), "ratio_mean": np.mean(r), "ratio_max": r.max(),
          "clip_frac_upper": np.mean((r > 1.28) & (adv > 0)),
          "clip_frac_lower": np.mean((r < 0.8) & (adv < 0)), "dual_clip_frac": 0.0}
  assert want["approx_kl"] > 1e-2 and want["clip_frac_upper"] + want["clip_frac_lower"] > 0.05
  for k, v in want.items():
    np.testing.assert_allclose(m[f"{k}_last_epoch"], v, rtol=1e-3, atol=1e-6, err_msg=k)


def test_non_finite_updates_are_skipped(model):
  batch = _batch(2)
  bad = batch.replace(advantages=batch.advantages.copy())
  bad.advantages[0, np.nonzero(batch.loss_mask[0])[0][0]] = np.nan
  before, state, metrics, _ = _run(model, train.LossConfig(), bad)
  assert float(metrics["skipped_updates"]) == 1.0
  assert int(state.skipped) == 1 and int(state.step) == 0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_gradient_element_anywhere_is_seen(bad):
  all_finite = jax.jit(train.step._all_finite)
  tree = {"a": np.zeros((3, 2), np.float32), "b": [np.ones(5, np.float32)] * 3,
          "c": np.full((), 2.0, np.float32)}
  assert bool(all_finite(tree))
  leaves, treedef = jax.tree.flatten(tree)
  for i, leaf in enumerate(leaves):
    for j in range(leaf.size):
      broken = [x.copy() for x in leaves]
      broken[i].reshape(-1)[j] = bad
      assert not bool(all_finite(jax.tree.unflatten(treedef, broken))), (i, j)


def test_logprob_gap_and_truncated_importance_sampling(model):
  batch = _batch(3)
  graphdef, params = nnx.split(model, nnx.Param)
  exact = _exact_sampler(model, batch)
  _, _, m, _ = _run(model, train.LossConfig(), exact)
  assert float(m["logprob_gap_mean_abs"]) < 1e-5 and float(m["logprob_gap_kl"]) < 1e-8
  # The policy's entropy on its action tokens, before the update, token mean;
  # against float64 from the full logits (the state before a token predicts it).
  logits = np.asarray(model(batch.tokens, batch.positions, batch.seq_ids), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  ent = -(np.exp(logp) * logp).sum(-1)
  on = np.roll(batch.loss_mask, -1, axis=1) > 0
  np.testing.assert_allclose(m["policy_entropy"], ent[on].mean(), rtol=1e-6)
  # The sampler was 0.5 nats more confident than the trainer on every token
  # (it sampled its own policy).
  shifted = exact.replace(old_logprobs=exact.old_logprobs + 0.5 * exact.loss_mask,
                          sampling_logprobs=exact.sampling_logprobs + 0.5 * exact.loss_mask)
  _, _, m, _ = _run(model, train.LossConfig(), shifted)
  np.testing.assert_allclose(m["logprob_gap_mean_abs"], 0.5, rtol=1e-4)
  np.testing.assert_allclose(m["ratio_mean"], np.exp(-0.5), rtol=1e-4)
  # KL(sampler || trainer) by k3, d = trainer - sampler = -0.5: e^-0.5 - 1 + 0.5.
  np.testing.assert_allclose(m["logprob_gap_kl"], np.exp(-0.5) - 0.5, rtol=1e-4)
  # TIS: ratios against the trainer's own log-probs (1), weights min(e^-0.5, cap).
  _, after_tis, m, _ = _run(model, train.LossConfig(is_correction="tis"), shifted)
  np.testing.assert_allclose(m["ratio_mean"], 1.0, rtol=1e-4)
  np.testing.assert_allclose(m["tis_weight_mean"], np.exp(-0.5), rtol=1e-4)
  assert float(m["tis_capped_frac"]) == 0.0
  _, after_exact, _, _ = _run(model, train.LossConfig(), exact)
  # With all ratios 1 the TIS gradient is the exact one scaled by e^-0.5.
  d_exact = jax.tree.map(lambda a, b: a - b, params, after_exact.params)

  def assert_scaled(after, scale):
    d = jax.tree.map(lambda a, b: a - b, params, after.params)
    for a, b in zip(jax.tree.leaves(d), jax.tree.leaves(d_exact)):
      np.testing.assert_allclose(a, scale * b, rtol=1e-3, atol=1e-7)

  assert_scaled(after_tis, np.exp(-0.5))
  # The weights' behaviour term is the distribution the tokens were drawn
  # from, not the policy's log-probs the sampler recorded beside it: a
  # sampler that drew from a flatter distribution (1 nat less on every
  # token) while the policy's log-probs are exact gets weights min(e, 2).
  flat = exact.replace(sampling_logprobs=exact.sampling_logprobs - exact.loss_mask)
  _, after_flat, m, _ = _run(model, train.LossConfig(is_correction="tis"), flat)
  np.testing.assert_allclose(m["tis_weight_mean"], 2.0, rtol=1e-4)
  assert float(m["tis_capped_frac"]) == 1.0
  assert_scaled(after_flat, 2.0)
  _, after_none, m, _ = _run(model, train.LossConfig(), flat)  # no weights
  np.testing.assert_allclose(m["ratio_mean"], 1.0, rtol=1e-4)
  assert_scaled(after_none, 1.0)


def test_later_ppo_epochs_keep_the_first_epochs_behaviour_logprobs(model):
  # The behaviour log-probs come from the first epoch's forward; later
  # epochs must compare against them, not against the moved policy. With
  # the sampler exact, TIS (ratios against the trainer's behaviour, weights
  # 1) then takes the same two updates as plain PPO on the sampler's.
  batch = _batch(4)
  exact = _exact_sampler(model, batch)
  tx = optax.sgd(3.0)
  _, plain, _, _ = _run(model, train.LossConfig(ppo_epochs=2), exact, tx=tx)
  _, tis, _, _ = _run(model, train.LossConfig(ppo_epochs=2, is_correction="tis"), exact, tx=tx)
  _, one, _, _ = _run(model, train.LossConfig(ppo_epochs=1), exact, tx=tx)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), plain.params,
                                       one.params))
  assert max(moved) > 1e-2  # the second epoch's ratios are far from 1
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(tis.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_value_loss_trains_the_value_head_at_turn_starts():
  model = models.Decoder(models.tiny_config("llama", vocab_size=64, value_head=True),
                         rngs=nnx.Rngs(0))
  batch = _batch(4)
  on = np.asarray(train.decision_mask(jnp.asarray(batch.turn_index))) & (batch.seq_ids >= 0)
  # Exactly one decision position per turn, right before its first action.
  n_turns = sum(len(set(batch.turn_index[b][batch.turn_index[b] >= 0])) for b in range(8))
  assert on.sum() == n_turns
  nxt = np.pad(batch.turn_index[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
  assert np.all(nxt[on] >= 0) and np.all(batch.loss_mask[on] == 0)
  targets = batch.replace(returns=np.where(on, 2.0, 0.0).astype(np.float32),
                          advantages=np.zeros_like(batch.advantages))
  cfg = train.LossConfig(value_coef=1.0)
  _, _, first, _ = _run(model, cfg, targets, tx=optax.adam(1e-2))
  _, _, last, _ = _run(model, cfg, targets, tx=optax.adam(1e-2), steps=20)
  assert float(last["value_loss"]) < 0.1 * float(first["value_loss"])


def test_a_detached_value_head_leaves_the_trunk_alone():
  # No advantages, no KL, no entropy: the value loss is the whole gradient.
  model = models.Decoder(models.tiny_config("llama", vocab_size=64, value_head=True),
                         rngs=nnx.Rngs(0))
  batch = _batch(4)
  batch = batch.replace(returns=np.full(batch.tokens.shape, 2.0, np.float32),
                        advantages=np.zeros_like(batch.advantages))
  moved = {}
  for detach in (False, True):
    before, state, m, _ = _run(model, train.LossConfig(value_coef=1.0, value_detach=detach),
                               batch)
    assert float(m["value_loss"]) > 0.1
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), before, state.params)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(diff)}
    head = [v for k, v in flat.items() if "value_head" in k]
    trunk = [v for k, v in flat.items() if "value_head" not in k]
    assert head and min(head) > 0
    moved[detach] = max(trunk)
  assert moved[False] > 1e-3 and moved[True] == 0.0


def test_sft_step_learns_the_action_tokens(model):
  batch = _batch(5)
  tx = optax.adam(1e-2)
  graphdef, state = train.init_train_state(model, tx, with_reference=False)
  step = train.SFTStep(graphdef, tx)
  history = []
  for _ in range(30):
    state, m = step(state, batch)
    history.append((float(m["sft_loss"]), float(m["token_accuracy"])))
  assert history[-1][0] < 0.3 * history[0][0]
  assert history[-1][1] > 0.9 > history[0][1]
  assert step.traces == 1


def test_sft_micro_batches_accumulate_the_full_batch_loss_exactly(model):
  batch = _batch(5)  # rows of 1-3 turns: micro-batches hold unequal token counts
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params):
    logits = nnx.merge(graphdef, params)(batch.tokens, batch.positions, batch.seq_ids)
    lp = losses.token_logprobs(logits, batch.tokens)
    return -jnp.sum(lp * batch.loss_mask) / jnp.sum(batch.loss_mask)

  want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params)
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  for micro in (1, 2, 4):
    graphdef, state = train.init_train_state(model, _CAPTURE, with_reference=False)
    state, m = train.SFTStep(graphdef, _CAPTURE, micro_batches=micro)(state, batch)
    np.testing.assert_allclose(m["sft_loss"], want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * scale)


def _windowed_batch(seed=6, vocab=64):
  """8 sliding-window trajectories of 2-4 views each, one view per row.

  Rows are ordered view by view (all first views, then all second ones,
  ...), so many trajectories' views land in different micro-batches.
  """
  rng = np.random.default_rng(seed)
  trajs = []
  for i in range(8):
    turns = 2 + i % 3
    segs = [Segment(Role.SYSTEM, rng.integers(0, vocab, 4))]
    for _ in range(turns):
      a = rng.integers(0, vocab, int(rng.integers(2, 6)))
      segs += [Segment(Role.ASSISTANT, a, -rng.uniform(3, 5, len(a))),
               Segment(Role.OBSERVATION, rng.integers(0, vocab, 3))]
    starts = [1 + 2 * k for k in range(turns)]  # each action sees only its own turn
    trajs.append(Trajectory(segs, reward=1.0, context_starts=starts))
  batch = collate(trajs, buckets=(32,), num_rows=32)
  order = np.lexsort((batch.seq_ids[:, 0], _view_number(batch.seq_ids[:, 0])))
  batch = jax.tree.map(lambda x: x[order], batch)
  adv = batch.loss_mask * rng.normal(size=batch.loss_mask.shape).astype(np.float32)
  return batch.replace(advantages=adv)


def _view_number(first_ids):
  """k for the k-th row of the same seq id (padding rows count as views too)."""
  seen: dict[int, int] = {}
  out = []
  for i in first_ids:
    out.append(seen.get(int(i), 0))
    seen[int(i)] = out[-1] + 1
  return np.asarray(out)


@pytest.mark.parametrize("agg", losses.LOSS_AGG_MODES)
def test_accumulation_is_exact_when_views_split_across_micro_batches(model, agg):
  batch = _windowed_batch()
  seq_of_row = batch.seq_ids.max(axis=1)
  for n in (2, 4, 8):  # most trajectories have views in two micro-batches
    parts = seq_of_row.reshape(n, -1)
    split = [s for s in set(seq_of_row[seq_of_row >= 0]) if sum(s in p for p in parts) > 1]
    assert len(split) >= 4, (n, split)
  base = dict(agg=agg, kl_beta=0.05, entropy_coef=0.01, norm_constant=20.0)
  loss_fn, params = _reference_loss(model, batch, train.LossConfig(**base),
                                    params_ref=params_of(model))
  want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params)
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  for micro in (1, 4):  # the whole batch, then views of a trajectory apart
    _, got, m, _ = _run(model, train.LossConfig(**base, micro_batches=micro), batch,
                        tx=_CAPTURE)
    np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * scale)


def test_the_loss_at_a_temperature_is_the_tempered_policys_in_every_term(model):
  # Policy, KL reference and entropy all at logits / 1.7: with the
  # reference at temperature 1 the KL term would not start at 0.
  batch = _batch(3)
  cfg = train.LossConfig(kl_beta=0.05, entropy_coef=0.01, temperature=1.7)
  loss_fn, params = _reference_loss(model, batch, cfg, params_ref=params_of(model))
  want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params)
  _, got, m, _ = _run(model, cfg, batch, tx=_CAPTURE)
  np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-6)
  assert abs(float(m["kl_k3_grad_forward"])) < 1e-6
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  for g, w in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * scale)


# Leaves the parameters alone and keeps the gradient as its state: the test
# reads the accumulated gradient itself, not a parameter difference (whose
# float32 rounding is larger than the accumulation error being tested).
_CAPTURE = optax.GradientTransformation(
    lambda params: jax.tree.map(jnp.zeros_like, params),
    lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _grouped_batch(seed=3, vocab=64, groups=3, group_size=3):
  """Groups of episodes with one prompt each (a system turn every group
  shares, then the group's task), unpacked, and its tree-packed form."""
  rng = np.random.default_rng(seed)
  system = list(rng.integers(0, vocab, 6))
  trajs = []
  for _ in range(groups):
    task = list(rng.integers(0, vocab, 4))
    for _ in range(group_size):
      segs = [Segment(Role.SYSTEM, system + task)]
      for _ in range(int(rng.integers(1, 3))):
        a = rng.integers(0, vocab, int(rng.integers(2, 6)))
        segs += [Segment(Role.ASSISTANT, a, -rng.uniform(3, 5, len(a))),
                 Segment(Role.OBSERVATION, rng.integers(0, vocab, 3))]
      trajs.append(Trajectory(segs, reward=1.0))
  batch = collate(trajs, buckets=(32,))
  adv = batch.loss_mask * rng.normal(size=batch.loss_mask.shape).astype(np.float32)
  batch = batch.replace(advantages=adv)
  tree = trajectory.pack_batch(batch, 2, share_prompts=True, row_length=64)
  held = lambda b: np.sum((b.seq_ids >= 0) | (b.prefix_ids >= 0))
  assert held(tree) < 0.85 * held(batch) and (tree.prefix_ids >= 0).any()
  return batch, tree


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_tree_rows_give_the_unshared_loss_and_gradients(model, agg):
  batch, tree = _grouped_batch()
  base = dict(agg=agg, kl_beta=0.05, entropy_coef=0.01)
  loss_fn, params = _reference_loss(model, batch, train.LossConfig(**base),
                                    params_ref=params_of(model))
  want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params)
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  for micro in (1, 2):
    _, got, m, _ = _run(model, train.LossConfig(**base, micro_batches=micro), tree,
                        tx=_CAPTURE)
    np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)
  # The trainer's log-probs of every action token: the same, token by token.
  graphdef, state = train.init_train_state(model, _CAPTURE, with_reference=False)
  lp = lambda b: np.asarray(train.step.action_logprobs(graphdef, state.params, b, 32, chunk=64))
  per_token = lambda b, x: {(int(s), int(p)): float(v) for s, p, v, on in zip(
      b.seq_ids.ravel(), b.positions.ravel(), x.ravel(), b.loss_mask.ravel()) if on}
  flat, shared = per_token(batch, lp(batch)), per_token(tree, lp(tree))
  assert flat.keys() == shared.keys()
  np.testing.assert_allclose([shared[k] for k in flat], list(flat.values()), atol=1e-5)
  # SFT too.
  sft = [train.SFTStep(*train.init_train_state(model, _CAPTURE, with_reference=False)[:1],
                       _CAPTURE)]
  outs = [sft[0](train.init_train_state(model, _CAPTURE, with_reference=False)[1], b)
          for b in (batch, tree)]
  np.testing.assert_allclose(outs[1][1]["sft_loss"], outs[0][1]["sft_loss"], rtol=1e-5)
  for g, w in zip(jax.tree.leaves(outs[1][0].opt_state), jax.tree.leaves(outs[0][0].opt_state)):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("layout", ["plain", "packed", "windowed"])
def test_heads_at_action_positions_equal_the_full_logits_loss(model, layout):
  batch = {"plain": lambda: _batch(7), "packed": lambda: _batch(7, pack=True),
           "windowed": _windowed_batch}[layout]()
  base = dict(agg="seq-mean-token-mean", kl_beta=0.05, entropy_coef=0.01)
  loss_fn, params = _reference_loss(model, batch, train.LossConfig(**base),
                                    params_ref=params_of(model))
  want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params)
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  # A chunk of 8 positions: several chunks, the last one padded.
  _, got, m, step = _run(model, train.LossConfig(**base, head_chunk=8), batch, tx=_CAPTURE)
  np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * scale)
  assert step.traces == 1


@pytest.mark.parametrize("layout", ["plain", "packed", "windowed"])
def test_the_value_head_runs_at_decision_states_only(layout):
  # The step reads the value head on the gathered action states only (the
  # state before a turn's first action token is its decision state); the
  # reference reads it at every position and masks by `decision_mask`.
  model = models.Decoder(models.tiny_config("qwen2", vocab_size=64, value_head=True),
                         rngs=nnx.Rngs(1))
  batch = {"plain": lambda: _batch(9), "packed": lambda: _batch(9, pack=True),
           "windowed": _windowed_batch}[layout]()
  on = np.asarray(train.decision_mask(jnp.asarray(batch.turn_index))) & (batch.seq_ids >= 0)
  rng = np.random.default_rng(0)
  batch = batch.replace(returns=np.where(on, rng.normal(size=on.shape), 0.0).astype(np.float32),
                        advantages=np.zeros_like(batch.advantages))
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params):
    m = nnx.merge(graphdef, params)
    values = m.values(m.hidden_states(batch.tokens, batch.positions, seq_ids=batch.seq_ids)[0])
    return jnp.sum(jnp.where(on, jnp.square(values - batch.returns), 0.0)) / on.sum()

  want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params)
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  for micro in (1, 4):
    _, got, m, _ = _run(model, train.LossConfig(value_coef=1.0, micro_batches=micro), batch,
                        tx=_CAPTURE)
    np.testing.assert_allclose(m["value_loss"], want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * scale)


def test_the_step_forms_no_full_vocabulary_logits():
  # One batch of 8 x 512 positions, the model at vocabulary 64 and 32k: what
  # the larger vocabulary adds to the step's temporaries is parameter-sized
  # (embedding and head gradients, ~48 MiB here), not logits-sized: one
  # [B, L, V] float32 array at 32k is 512 MiB, and the step used to form
  # several.
  def temp_bytes(vocab):
    model = models.Decoder(models.tiny_config("qwen2", vocab_size=vocab), rngs=nnx.Rngs(0))
    graphdef, state = train.init_train_state(model, _CAPTURE, with_reference=True)
    step = train.RLStep(graphdef, _CAPTURE, train.LossConfig(
        kl_beta=0.05, entropy_coef=0.01, head_chunk=32))
    batch = _batch(8, vocab=vocab, buckets=(512,))
    programs = step.lower(state, batch, losses.action_bucket(
        losses.most_actions(batch.loss_mask), 512))
    assert set(programs) == {"reference", "step"}
    # They run one after the other: the larger is the step's share.
    return max(p.compile().memory_analysis().temp_size_in_bytes for p in programs.values())

  logits = 8 * 512 * 32768 * 4
  assert temp_bytes(32768) - temp_bytes(64) < logits / 8


def test_a_too_small_action_bucket_skips_the_update(model):
  batch = _batch(10)
  most = losses.most_actions(batch.loss_mask)
  _, _, m, _ = _run(model, train.LossConfig(), batch)
  assert float(m["dropped_actions"]) == 0 and float(m["skipped_updates"]) == 0
  graphdef, state = train.init_train_state(model, optax.sgd(1.0), with_reference=False)
  step = train.RLStep(graphdef, optax.sgd(1.0), train.LossConfig())
  first = jax.tree.map(jnp.copy, state.params)
  state, m = step(state, batch, num_actions=most - 2)
  assert float(m["dropped_actions"]) >= 2 and float(m["skipped_updates"]) == 1
  chex.assert_trees_all_equal(state.params, first)
  sft = train.SFTStep(graphdef, optax.sgd(1.0))
  state, m = sft(state, batch, num_actions=most - 1)
  assert float(m["dropped_actions"]) >= 1
  chex.assert_trees_all_equal(state.params, first)


def test_the_behaviour_forward_is_a_choice(model):
  batch = _batch(9)
  _, _, with_fwd, _ = _run(model, train.LossConfig(), batch, tx=_CAPTURE)
  _, _, without, _ = _run(model, train.LossConfig(behaviour_forward=False), batch,
                          tx=_CAPTURE)
  # Same loss from the sampler's log-probs; no gap metrics without the forward.
  np.testing.assert_allclose(without["loss"], with_fwd["loss"], rtol=1e-6)
  assert "logprob_gap_mean_abs" in with_fwd and "logprob_gap_mean_abs" not in without
  # "tis" reads the first epoch's own log-probs, metrics or not.
  _, tis_fwd, _, _ = _run(model, train.LossConfig(is_correction="tis"), batch)
  _, tis_without, _, _ = _run(model, train.LossConfig(is_correction="tis",
                                                      behaviour_forward=False), batch)
  chex.assert_trees_all_close(tis_without.params, tis_fwd.params, rtol=1e-6, atol=1e-7)
  _, plain, _, _ = _run(model, train.LossConfig(), batch)
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(plain.params), jax.tree.leaves(tis_fwd.params))) > 1e-4


def test_aggregation_weights_split_by_hand():
  # One trajectory, two views (rows 0 and 1, seq id 0) with 2 and 3 action
  # tokens of loss 1 and 2; a second trajectory (row 2) with 1 token of loss 4.
  x = np.array([[1, 1, 0], [2, 2, 2], [4, 0, 0]], np.float32)
  m = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]], np.float32)
  ids = np.array([[0, 0, 0], [0, 0, 0], [1, -1, -1]], np.int32)
  # seq-mean-token-sum: ((2 + 6) + 4) / 2 sequences = 6; token-mean: 12 / 6 = 2;
  # seq-mean-token-mean: (8 / 5 + 4 / 1) / 2 = 2.8; -norm with C = 4: 6 / 4.
  want = {"seq-mean-token-sum": 6.0, "token-mean": 2.0, "seq-mean-token-mean": 2.8,
          "seq-mean-token-sum-norm": 1.5}
  for mode, value in want.items():
    kw = dict(seq_ids=ids, norm_constant=4.0)
    np.testing.assert_allclose(losses.aggregate_loss(x, m, mode, **kw), value, rtol=1e-6)
    w = np.asarray(losses.aggregation_weights(m, mode, **kw))
    split = sum(float(losses.weighted_sum(x[r:r + 1], w[r:r + 1])) for r in range(3))
    np.testing.assert_allclose(split, value, rtol=1e-6)


def test_logprob_gap_kl_is_k3_of_kl_sampler_to_trainer():
  # The k3 estimator exp(d) - 1 - d (d = trainer - sampler log-prob),
  # averaged over the sampler's own distribution, is exactly KL(sampler || trainer).
  rng = np.random.default_rng(0)
  s = jax.nn.log_softmax(jnp.asarray(rng.normal(size=7), jnp.float32))
  t = jax.nn.log_softmax(jnp.asarray(rng.normal(size=7), jnp.float32))
  per_token = losses.kl_penalty(s[None], t[None], "k3")[0]
  exact = jnp.sum(jnp.exp(s) * (s - t))
  np.testing.assert_allclose(jnp.sum(jnp.exp(s) * per_token), exact, rtol=1e-5)
  # The reverse direction (the old metric's exp(-d) - 1 + d) is another number.
  assert abs(float(jnp.sum(jnp.exp(s) * (jnp.exp(s - t) - 1 - (s - t)))) - float(exact)) > 0.05


def _changed_fraction(before, after) -> float:
  """Fraction of all weights (N(0, 0.02) kernels and the rest) that moved."""
  moved = sum(int(np.sum(np.asarray(a) != np.asarray(b)))
              for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
  return moved / sum(np.size(a) for a in jax.tree.leaves(before))


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_compute_trains_float32_masters(param_dtype, tmp_path):
  # Under bf16 activations the masters and AdamW's moments stay float32, so
  # one 1e-6 step moves (nearly) every weight; bf16 masters would round
  # most such updates away (~2% of the weights move).
  cfg = models.tiny_config("qwen2", vocab_size=64, dtype=jnp.bfloat16,
                           param_dtype=param_dtype)
  model = models.Decoder(cfg, rngs=nnx.Rngs(0))
  tx = train.make_optimizer(train.OptimConfig(learning_rate=1e-6, warmup_steps=0))
  graphdef, state = train.init_train_state(model, tx, with_reference=True)
  before = jax.tree.map(jnp.copy, state.params)
  state, metrics = train.RLStep(graphdef, tx, train.LossConfig(kl_beta=0.1))(
      state, _batch())
  assert float(metrics["skipped_updates"]) == 0
  moved = _changed_fraction(before, state.params)
  if param_dtype == jnp.bfloat16:
    assert moved < 0.1
    return
  dtypes = {x.dtype for x in jax.tree.leaves((state.params, state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating)}
  assert dtypes == {jnp.dtype(jnp.float32)}
  assert moved > 0.99
  # A checkpoint keeps the float32 masters and moments.
  ckpt = checkpointing.Checkpointer(tmp_path)
  ckpt.save(1, train.checkpointed(state))
  saved = ckpt.saved_tree(1)
  assert {jnp.dtype(m.dtype) for m in jax.tree.leaves((saved["params"], saved["opt_state"]))
          if jnp.issubdtype(m.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
  # The reference is the masters' bf16 copy: half the bytes, and the same
  # forward, since every layer casts its weights to bf16 before use.
  assert {x.dtype for x in jax.tree.leaves(state.ref_params)} == {jnp.dtype(jnp.bfloat16)}
  batch = _batch()
  logits = lambda p: nnx.merge(graphdef, p)(batch.tokens, batch.positions, batch.seq_ids)
  np.testing.assert_array_equal(np.asarray(logits(before), np.float32),
                                np.asarray(logits(train.reference_params(before,
                                                                         jnp.bfloat16)),
                                           np.float32))


def test_the_sampler_holds_a_compute_dtype_copy():
  from agentrl_jax.sampling import Sampler  # pylint: disable=g-import-not-at-top
  cfg = models.tiny_config("qwen2", vocab_size=64, dtype=jnp.bfloat16)
  model = models.Decoder(cfg, rngs=nnx.Rngs(0))
  sampler = Sampler(model, num_slots=2, cache_length=32, max_decode_length=4,
                    length_buckets=(8,))
  masters = nnx.split(model, nnx.Param)[1]
  for params in (None, jax.tree.map(lambda x: x + 1e-3, masters)):
    if params is not None:
      sampler.update_params(params)  # weight sync from float32 masters
    want = masters if params is None else params
    flat = dict(nnx.to_flat_state(nnx.split(nnx.merge(sampler.graphdef, sampler.params),
                                            nnx.Param)[1]))
    for path, leaf in nnx.to_flat_state(want):
      got = flat[path].get_value()
      assert got.dtype == jnp.bfloat16
      np.testing.assert_array_equal(np.asarray(got, np.float32),
                                    np.asarray(leaf.get_value().astype(jnp.bfloat16),
                                               np.float32))


def test_a_remat_model_takes_the_same_step(model):
  # The step's forwards (also the behaviour one, under lax.map) run the
  # remat layers; the update equals the plain model's.
  remat = models.Decoder(model.cfg.replace(remat=True), rngs=nnx.Rngs(0))
  nnx.update(remat, nnx.state(model, nnx.Param))
  cfg = train.LossConfig(kl_beta=0.05, micro_batches=2)
  (_, plain, m1, _), (_, again, m2, _) = (_run(m, cfg, _batch()) for m in (model, remat))
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(again.params)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)


def test_each_compile_returns_the_compilers_memory_once(model, monkeypatch):
  # The step compiles ahead of its first call per input signature and then
  # hands the compiler's freed host memory back (malloc_trim), before the
  # step's own temporaries are allocated; a repeated signature compiles
  # nothing and releases nothing.
  from agentrl_jax import host_memory  # pylint: disable=g-import-not-at-top
  released = []
  monkeypatch.setattr(host_memory, "release_freed", lambda: released.append(step.traces))
  tx = optax.sgd(0.1)
  graphdef, state = train.init_train_state(model, tx, with_reference=False)
  step = train.RLStep(graphdef, tx, train.LossConfig())
  for batch in (_batch(1), _batch(2), _batch(3, buckets=(64,)), _batch(4)):
    state, _ = step(state, batch)
  assert step.traces == 2 and released == [1, 2]


def _bf16_programs(layers, vocab, intermediate, kl_beta=0.01):
  """{program: compiled} of the RL step (nothing allocated): bf16 compute
  over float32 masters, remat, 2 micro-batches, 4 x 32 tokens."""
  cfg = models.tiny_config(
      "qwen2", vocab_size=vocab, intermediate_size=intermediate, num_layers=layers,
      tie_word_embeddings=True, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=True)
  tx = train.make_optimizer(train.OptimConfig(learning_rate=1e-6))
  model = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef = nnx.split(model, nnx.Param)[0]
  state = jax.eval_shape(lambda: train.init_train_state(
      models.Decoder(cfg, rngs=nnx.Rngs(0)), tx, with_reference=True)[1])
  step = train.RLStep(graphdef, tx, train.LossConfig(kl_beta=kl_beta, micro_batches=2))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((4, 32), x.dtype),
                       _batch(4, vocab=vocab, buckets=(32,)))
  return {name: p.compile() for name, p in step.lower(state, batch, 8).items()}


def _bf16_temps(layers, vocab, intermediate, kl_beta=0.01):
  """{program: XLA's temporary bytes} of `_bf16_programs`."""
  return {name: p.memory_analysis().temp_size_in_bytes
          for name, p in _bf16_programs(layers, vocab, intermediate, kl_beta).items()}


def test_the_steps_program_grows_linearly_with_depth():
  # An XLA:CPU executable keeps its HLO module in host memory. The AND of
  # the per-leaf finiteness flags, fused into every leaf's update, made the
  # program quadratic in the number of leaves: at Qwen2.5-0.5B the
  # executable held 1.5 GiB (0.5 GiB now, benchmarks/README.md). Here a layer added 10.7K instructions from 2 to 4
  # layers and 15.9K from 4 to 8; now 5.2K both.
  def instructions(layers):
    return len(_bf16_programs(layers, 256, 256)["step"].as_text().splitlines())
  sizes = [instructions(n) for n in (2, 4, 8)]
  per_layer = [(sizes[1] - sizes[0]) / 2, (sizes[2] - sizes[1]) / 4]
  assert per_layer[1] < 1.2 * per_layer[0], (sizes, per_layer)


def test_the_bf16_step_copies_neither_the_state_nor_the_table():
  # What a parameter costs in the RL step's temporaries: growing the depth
  # adds per layer the gradient accumulator and the micro-batch loop's copy
  # of the parameters (2 float32 copies of the layer); growing the
  # vocabulary adds per [V, d] table the accumulator, the lookup's scatter
  # and the head's float32 cast. Before the update was ordered
  # (`step._update`) it also copied every leaf's AdamW moments (3.2 layers
  # here); before the lookup gathered rows first and the head cast per
  # chunk, 6.1 tables.
  layer = 3 * 128 * 2048 * 4  # the MLP's matrices in float32
  per_layer = (_bf16_temps(4, 256, 2048)["step"] - _bf16_temps(2, 256, 2048)["step"]) / 2 / layer
  table = 32768 * 128 * 4
  per_table = (_bf16_temps(2, 65536, 256)["step"] - _bf16_temps(2, 32768, 256)["step"]) / table
  assert per_layer < 2.6 and per_table < 4.5, (per_layer, per_table)


def test_the_reference_forward_adds_nothing_to_the_steps_temporaries():
  # The KL reference's forward is a program of its own, run before the
  # step: the step's temporaries are those of a step without a KL term (in
  # one program they were 3.7 MB more here, and at Qwen2.5-0.5B's width
  # XLA:CPU hoisted a float32 copy of the whole bf16 reference out of the
  # micro-batch loop: 1.2 GiB, benchmarks/step_memory.py).
  with_kl, without = _bf16_temps(2, 256, 2048), _bf16_temps(2, 256, 2048, kl_beta=0.0)
  assert set(with_kl) == {"reference", "step"} and set(without) == {"step"}
  assert with_kl["step"] <= without["step"] + 1024, (with_kl, without)
  assert with_kl["reference"] < with_kl["step"]
