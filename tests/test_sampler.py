"""The KV-cache sampler: consistency with the trainer, stops, KV reuse, no recompiles."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import losses, models
from agentrl_jax.sampling import processing
from agentrl_jax.sampling import (
    STOP_BUDGET, STOP_CACHE_FULL, STOP_SEQUENCE, Sampler, SamplingParams, sample)
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate

CACHE = 96


def _peaked_model(cfg):
  # A larger init scale than the default so the random policy is peaked
  # enough for greedy paths and stops to be informative.
  m = models.Decoder(cfg, rngs=nnx.Rngs(0))
  for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
    if path[-1] in ("kernel", "embedding"):
      var.set_value(var.get_value() * 4.0)
  return m


def _sampler(model):
  return Sampler(model, num_slots=4, cache_length=CACHE, max_decode_length=12,
                 length_buckets=(8, 16))


@pytest.fixture(scope="module")
def model():
  return _peaked_model(models.tiny_config("qwen2", vocab_size=64))


@pytest.fixture(scope="module")
def sampler(model):
  return _sampler(model)


def _greedy_reference(model, prompt, n, width=32):
  """Argmax over full (uncached) forwards, one token at a time.

  Right-padding to a fixed width keeps one compiled forward; causal
  attention makes the padding invisible to the real positions.
  """
  forward = nnx.jit(lambda m, t: m(t))
  ids = list(prompt)
  for _ in range(n):
    logits = forward(model, jnp.asarray([ids + [0] * (width - len(ids))]))
    ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
  return ids[len(prompt):]


def test_greedy_decode_equals_argmax_over_full_forwards(model, sampler):
  prompts = {1: [3, 4, 5], 3: [9, 8, 7, 6, 5, 4, 3, 2, 1, 10]}
  state = sampler.prefill(sampler.init_state(), list(prompts), list(prompts.values()))
  state, actions = sampler.decode(state, list(prompts), max_new_tokens=10, temperature=0.0)
  for slot, prompt in prompts.items():
    assert actions[slot].tokens == _greedy_reference(model, prompt, 10)
    assert actions[slot].stop_reason == STOP_BUDGET
    assert actions[slot].sampled_logprobs == [0.0] * 10


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "gemma3_text"])
def test_multi_turn_logprobs_match_the_trainer(arch, model, sampler):
  """prefill -> decode -> extend -> decode -> extend -> decode, 3 slots, sampled."""
  if arch != "qwen2":  # sliding layers' window of 8 < the rows' 20-50 tokens
    model = _peaked_model(models.tiny_config(arch, vocab_size=64, sliding_window=8))
    sampler = _sampler(model)
  rng = np.random.default_rng(0)
  slots = [0, 2, 3]
  prompts = [list(rng.integers(0, 64, n)) for n in (5, 11, 2)]
  segments = {s: [Segment(Role.SYSTEM, p)] for s, p in zip(slots, prompts)}
  state = sampler.prefill(sampler.init_state(seed=1), slots, prompts)
  for turn in range(3):
    state, actions = sampler.decode(
        state, slots, max_new_tokens=[4, 9, 6], temperature=[1.0, 0.7, 1.3],
        top_p=[1.0, 0.9, 1.0], stop_sequences=[[17]])
    observations = []
    for s in slots:
      a = actions[s]
      assert a.tokens and len(a.tokens) == len(a.raw_logprobs)
      segments[s].append(Segment(Role.ASSISTANT, a.tokens, a.raw_logprobs))
      observations.append(list(rng.integers(0, 64, int(rng.integers(1, 7)))))
    if turn < 2:
      state = sampler.extend(state, slots, observations)
      for s, obs in zip(slots, observations):
        segments[s].append(Segment(Role.OBSERVATION, obs))
  trajs = [Trajectory(segments[s]) for s in slots]
  batch = collate(trajs, buckets=(64,))
  logits = model(jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                 jnp.asarray(batch.seq_ids))
  teacher = np.asarray(losses.token_logprobs(logits, jnp.asarray(batch.tokens)))
  on = batch.loss_mask > 0
  assert on.sum() > 20
  np.testing.assert_allclose(teacher[on], batch.old_logprobs[on], atol=1e-4)
  # The first token after each observation (a turn boundary) is among them.
  boundary = on & ~np.pad(on, ((0, 0), (1, 0)))[:, :-1]
  assert boundary.sum() == 9


def test_extend_equals_prefilling_the_concatenation(sampler):
  a, b = [1, 2, 3, 4, 5, 6], list(range(10, 30))  # b spans two 16-buckets: chunked
  one = sampler.extend(sampler.prefill(sampler.init_state(), [2], [a]), [2], [b])
  whole = sampler.prefill(sampler.init_state(), [2], [a + b])
  np.testing.assert_allclose(one.next_logits[2], whole.next_logits[2], atol=2e-5)
  assert int(one.lengths[2]) == int(whole.lengths[2]) == 26


def test_fork_restarts_a_slot_from_a_snapshot_prefix(sampler):
  # An episode of 30 tokens in slot 0 is snapshot, its slot reused; slot 2
  # forks at 21 tokens and is extended by the 22nd: the same next-token
  # logits and greedy continuation as prefilling those 22 tokens.
  prompt = list(range(1, 11))
  state = sampler.prefill(sampler.init_state(), [0], [prompt])
  state, actions = sampler.decode(state, [0], max_new_tokens=12, temperature=1.0)
  state = sampler.extend(state, [0], [[40, 41, 42, 43, 44, 45, 46, 47]])
  held = prompt + actions[0].tokens + [40, 41, 42, 43, 44, 45, 46, 47]
  assert int(state.lengths[0]) == len(held) == 30
  snap = sampler.snapshot(state, 0, 30)
  # The smallest window that holds 30, in the keys' and values' layouts.
  assert snap.k[0].shape[2] == snap.v[0].shape[1] == CACHE // 2
  state = sampler.prefill(state, [0], [[7] * 50])  # the source slot is reused
  state = sampler.fork(state, 2, snap, 21)
  assert int(state.lengths[2]) == 21
  state = sampler.extend(state, [2], [held[21:22]])
  state = sampler.prefill(state, [3], [held[:22]])
  np.testing.assert_allclose(state.next_logits[2], state.next_logits[3], atol=2e-5)
  _, greedy = sampler.decode(state, [2, 3], max_new_tokens=10, temperature=0.0)
  assert greedy[2].tokens == greedy[3].tokens
  with pytest.raises(ValueError, match="fork length 31 outside"):
    sampler.fork(state, 1, snap, 31)
  with pytest.raises(ValueError, match="snapshot length 0 outside"):
    sampler.snapshot(state, 1, 0)


def _greedy(sampler, prompt, stops=(), n=10, slot=0):
  state = sampler.prefill(sampler.init_state(), [slot], [prompt])
  _, actions = sampler.decode(state, [slot], stop_sequences=stops,
                              max_new_tokens=n, temperature=0.0)
  return actions[slot]


def test_stop_sequences(sampler):
  prompt = [5, 6, 7]
  free = _greedy(sampler, prompt).tokens
  assert len(set(free[:6])) >= 3, free  # the random policy is not stuck
  # Two tokens spanning a boundary: stops right after them, stop tokens kept.
  got = _greedy(sampler, prompt, stops=[free[3:5]])
  first = next(i for i in range(1, 10) if free[i - 1:i + 1] == free[3:5])
  assert got.tokens == free[:first + 1] and got.stop_reason == STOP_SEQUENCE
  # Only partly present (first token matches, second never comes): no stop.
  absent = next(t for t in range(64) if t not in free)
  got = _greedy(sampler, prompt, stops=[[free[3], absent]])
  assert got.tokens == free and got.stop_reason == STOP_BUDGET
  # The very first token.
  got = _greedy(sampler, prompt, stops=[[absent], [free[0]]])
  assert got.tokens == free[:1] and got.stop_reason == STOP_SEQUENCE
  # A stop sequence completed only with prompt tokens does not count.
  got = _greedy(sampler, prompt, stops=[[prompt[-1], free[0]]])
  assert got.tokens == free


def test_a_stopping_slot_does_not_affect_others(sampler):
  p0, p1 = [5, 6, 7], [40, 41, 42, 43]
  alone = _greedy(sampler, p1, slot=1).tokens
  stop_early = [_greedy(sampler, p0).tokens[0]]
  state = sampler.prefill(sampler.init_state(), [0, 1], [p0, p1])
  state, actions = sampler.decode(state, [0, 1], stop_sequences=[stop_early],
                                  max_new_tokens=10, temperature=0.0)
  assert len(actions[0].tokens) == 1
  if stop_early[0] not in alone:
    assert actions[1].tokens == alone
  else:  # the same stop applies to slot 1: it must stop exactly there
    assert actions[1].tokens == alone[:alone.index(stop_early[0]) + 1]
  # Slot 0 resumes from its own state unaffected by slot 1's longer decode.
  state, more = sampler.decode(state, [0], max_new_tokens=3, temperature=0.0)
  full = _greedy(sampler, p0, n=4).tokens
  assert actions[0].tokens + more[0].tokens == full


def test_no_recompilation_across_turns_and_episodes(model):
  # One attention window: the decode programs are then one per row bucket.
  sampler = Sampler(model, num_slots=4, cache_length=CACHE, max_decode_length=8,
                    length_buckets=(8, 16), attention_windows=(CACHE,))
  rng = np.random.default_rng(1)

  def episode(seed, slots):
    state = sampler.prefill(sampler.init_state(seed), slots,
                            [list(rng.integers(0, 64, 3 + i)) for i in range(len(slots))])
    for turn in range(3):
      state, _ = sampler.decode(state, slots, max_new_tokens=int(rng.integers(2, 8)),
                                temperature=float(rng.uniform(0, 2)),
                                top_k=int(rng.integers(0, 5)),
                                stop_sequences=[[int(rng.integers(64))]] * (turn + 1))
      state = sampler.extend(state, slots,
                             [list(rng.integers(0, 64, int(rng.integers(1, 8))))
                              for _ in slots])
    return state

  state = episode(0, [0, 1, 2])
  counts = dict(sampler.compile_counts)
  assert counts == {"extend": 1, "decode": 1}
  episode(1, [3, 1, 0])  # new episodes in reused slots, other lengths, same buckets
  # Slots released and reused mid-run, other slots untouched.
  state = sampler.release(state, [1])
  state = sampler.prefill(state, [1, 2, 0], [[1, 2], [3, 4, 5, 6, 7], [9]])
  state, _ = sampler.decode(state, [1, 2, 0], max_new_tokens=3)
  assert dict(sampler.compile_counts) == counts
  # Touching 2 slots is a new row bucket (1, 2, 4 rows): one compile, once.
  state = sampler.extend(state, [1, 2], [[1], [2, 3]])
  state, _ = sampler.decode(state, [1, 2], max_new_tokens=3)
  state = sampler.extend(state, [0, 3], [[4, 5, 6], [7]])
  state, _ = sampler.decode(state, [3, 0], max_new_tokens=2)
  assert dict(sampler.compile_counts) == {"extend": 2, "decode": 2}


def test_windowed_decode_equals_full_cache_decode(model):
  """Attending over a cache prefix gives the full cache's tokens and
  log-probs; the window grows with the contexts, and warmup compiled every
  window beforehand."""
  kw = dict(num_slots=2, cache_length=CACHE, max_decode_length=12, length_buckets=(8, 16))
  windowed = Sampler(model, attention_windows=(16, 48, CACHE), **kw)
  full = Sampler(model, attention_windows=(CACHE,), **kw)
  warm = windowed.warmup(windowed.init_state()).replace(rng=jax.random.key(7))
  counts = dict(windowed.compile_counts)
  assert counts == {"extend": 2 * 2, "decode": 2 * 3}  # rows {1, 2} x buckets / windows
  assert np.asarray(warm.lengths).tolist() == [0, 0]
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(0, 64, n)) for n in (3, 9)]
  states = [s.prefill(st, [1, 0], prompts)
            for s, st in ((windowed, warm), (full, full.init_state(7)))]
  for turn, (budget, temperature) in enumerate([(4, 0.0), (12, 1.0), (12, 0.7), (12, 1.0),
                                                (4, 0.0)]):
    got = []
    for i, s in enumerate((windowed, full)):
      states[i], actions = s.decode(states[i], [1, 0], max_new_tokens=budget,
                                    temperature=temperature)
      got.append(actions)
    for slot in (1, 0):
      assert got[0][slot].tokens == got[1][slot].tokens, (turn, slot)
      np.testing.assert_allclose(got[0][slot].raw_logprobs, got[1][slot].raw_logprobs,
                                 atol=1e-5)
    observation = [list(rng.integers(0, 64, 8))] * 2
    states = [s.extend(st, [1, 0], observation) for s, st in zip((windowed, full), states)]
  # Contexts grew from 9 + 4 to 93 tokens (the third decode, from 41 to 53,
  # crosses 48): every window was used, none compiled after warmup.
  assert int(np.max(np.asarray(states[0].lengths))) > 48
  assert dict(windowed.compile_counts) == counts and full.compile_counts["decode"] == 1
  np.testing.assert_array_equal(np.asarray(states[0].lengths), np.asarray(states[1].lengths))


def test_cache_full_and_input_errors(model):
  sampler = Sampler(model, num_slots=2, cache_length=20, max_decode_length=16,
                    length_buckets=(8, 16))
  state = sampler.prefill(sampler.init_state(), [0], [list(range(15))])
  state, actions = sampler.decode(state, [0], max_new_tokens=16)
  assert len(actions[0].tokens) == 5 and actions[0].stop_reason == STOP_CACHE_FULL
  with pytest.raises(ValueError, match="exceed the cache length 20"):
    sampler.extend(state, [0], [[1]])
  with pytest.raises(ValueError, match="distinct"):
    sampler.prefill(state, [1, 1], [[1], [2]])
  with pytest.raises(ValueError, match="empty token list"):
    sampler.prefill(state, [1], [[]])
  with pytest.raises(ValueError, match="token ids must be in"):
    sampler.prefill(state, [1], [[64]])
  with pytest.raises(ValueError, match="max_decode_length"):
    sampler.decode(state, [1], max_new_tokens=17)
  assert sampler.decode(state, []) == (state, {})
  with pytest.raises(ValueError, match="include cache_length"):
    Sampler(model, num_slots=2, cache_length=20, attention_windows=(8, 16))
  with pytest.raises(ValueError, match="the stops need 131 automaton states"):
    sampler.decode(state, [1], stop_sequences=[[t] * 65 for t in (1, 2)])


# -- Sampling controls --------------------------------------------------------------------

def test_sample_controls_and_logprobs():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4))
  params = SamplingParams(temperature=jnp.array([0.0, 1.0, 1.0, 2.0]),
                          top_k=jnp.array([0, 2, 0, 0]),
                          top_p=jnp.array([1.0, 1.0, 0.7, 1.0]))
  keys = jax.random.split(jax.random.key(0), 4000)
  tokens, raw, sampled = jax.vmap(lambda k: sample(k, logits, params))(keys)
  tokens = np.asarray(tokens)
  assert np.all(tokens[:, 0] == 0)  # greedy
  assert set(tokens[:, 1]) == {0, 1}  # top-k 2
  assert set(tokens[:, 2]) == {0, 1}  # nucleus 0.7: 0.5 + 0.3 crosses it
  np.testing.assert_allclose(np.mean(tokens[:, 1] == 0), 0.5 / 0.8, atol=0.03)
  temp2 = np.sqrt([0.5, 0.3, 0.15, 0.05]) / np.sqrt([0.5, 0.3, 0.15, 0.05]).sum()
  freq = np.bincount(tokens[:, 3], minlength=4) / len(tokens)
  np.testing.assert_allclose(freq, temp2, atol=0.03)
  # Raw log-probs ignore the controls; sampled ones are the renormalised ones.
  picked = np.log([0.5, 0.3, 0.15, 0.05])[tokens]
  np.testing.assert_allclose(raw, picked, rtol=1e-5)
  np.testing.assert_allclose(sampled[:, 0], 0.0)
  np.testing.assert_allclose(sampled[:, 1], np.log(np.array([0.5, 0.3])[tokens[:, 1]] / 0.8),
                             rtol=1e-5)
  np.testing.assert_allclose(sampled[:, 3], np.log(temp2[tokens[:, 3]]), rtol=1e-5)


def _hf_filter(logits, top_k, top_p):
  """transformers' TopKLogitsWarper then TopPLogitsWarper on one row."""
  import torch  # pylint: disable=g-import-not-at-top
  from transformers.generation import logits_process as lp  # pylint: disable=g-import-not-at-top
  scores = torch.tensor(np.asarray(logits, np.float32))[None]
  if top_k:
    scores = lp.TopKLogitsWarper(top_k)(None, scores)
  if top_p < 1.0:
    scores = lp.TopPLogitsWarper(top_p)(None, scores)
  return np.isfinite(scores[0].numpy())


def test_top_k_then_top_p_matches_transformers():
  # .4/.3/.2/.1 with k=2, p=.5: the nucleus of the renormalised top-2
  # (.571, .429) is the first token alone; over the full distribution it
  # would take two.
  logits = jnp.log(jnp.array([[0.3, 0.4, 0.1, 0.2]]))
  kept = np.isfinite(processing._filter(logits, jnp.array([2]), jnp.array([0.5])))
  np.testing.assert_array_equal(kept[0], [False, True, False, False])
  rng = np.random.default_rng(0)
  rows, settings = [], []
  for i in range(96):
    vocab = int(rng.choice([5, 37, 300]))
    # Every third row has coarse logits: ties inside and at both cuts.
    row = (rng.integers(-3, 3, vocab) * 0.5 if i % 3 == 0
           else rng.normal(0, 2, vocab)).astype(np.float32)
    k, p = int(rng.choice([0, 1, 3, 8, 400])), float(rng.choice([1.0, 0.3, 0.6, 0.9, 0.99]))
    rows.append(row)
    settings.append((k, p))
  ties = 0
  for row, (k, p) in zip(rows, settings):
    got = np.isfinite(processing._filter(jnp.asarray(row)[None], jnp.array([k]),
                                         jnp.array([p], jnp.float32)))[0]
    want = _hf_filter(row, k, p)
    # Where transformers' sort split a tie at the nucleus's edge, the whole
    # tie is kept: every extra token has the value of the last one it kept.
    extra = got & ~want
    assert not (want & ~got).any(), (k, p, row)
    assert np.all(row[extra] == row[want].min()), (k, p, row)
    ties += extra.any()
  assert ties  # the coarse rows did split ties


def _three_blocks():
  """Mass 0.25 on token 5 (block 0), 0.5 on 130 (block 1), 0.25 on 299
  (block 2, whose last 84 entries are padding); every other token 0."""
  probs = np.zeros(300)
  probs[[5, 130, 299]] = [0.25, 0.5, 0.25]
  return jnp.log(jnp.asarray(probs, jnp.float32))[None]


@pytest.mark.parametrize("u, want", [
    ((0.0, 0.0), 5),  # the first token with mass, not token 0
    ((0.2, 0.999), 5),
    ((0.25, 0.0), 130),  # a CDF edge belongs to the interval it opens
    ((0.7, 0.5), 130),
    ((0.75, 0.0), 299),
    ((1 - 2 ** -24, 1 - 2 ** -24), 299),  # never the padding beyond V
])
def test_draw_picks_the_token_whose_interval_holds_u(u, want):
  got = processing.draw(jnp.asarray([u], jnp.float32), _three_blocks())
  assert got.dtype == jnp.int32 and int(got[0]) == want


def test_draw_follows_the_distribution_and_never_draws_a_zero():
  rng = np.random.default_rng(0)
  probs = np.zeros(300)
  support = [0, 7, 127, 128, 200, 255, 256, 299]  # block edges included
  probs[support] = rng.dirichlet(np.ones(len(support)))
  logp = jnp.log(jnp.asarray(np.broadcast_to(probs, (40_000, 300)), jnp.float32))
  tokens = np.asarray(processing.draw(jnp.asarray(rng.random((40_000, 2)), jnp.float32), logp))
  freq = np.bincount(tokens, minlength=300) / len(tokens)
  assert set(np.flatnonzero(freq)) <= set(support)
  np.testing.assert_allclose(freq, probs, atol=0.012)  # > 4 standard errors


def test_raw_logprobs_are_the_trainers_policy_at_its_temperature():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(3, 50))
  params = SamplingParams.make(3).replace(temperature=jnp.asarray([1.0, 1.5, 0.0]))
  tokens, raw, sampled = jax.jit(sample, static_argnums=3)(
      jax.random.key(3), jnp.asarray(logits, jnp.float32), params, 1.5)
  z = logits / 1.5
  want = z - np.log(np.exp(z).sum(-1, keepdims=True))  # float64
  np.testing.assert_allclose(raw, want[np.arange(3), np.asarray(tokens)], rtol=1e-5)
  # The row sampled at the policy's temperature: the loss is on-policy there.
  np.testing.assert_allclose(raw[1], sampled[1], rtol=1e-6)
  assert int(tokens[2]) == int(np.argmax(logits[2]))  # greedy rows unchanged
  with pytest.raises(ValueError, match="policy_temperature"):
    Sampler(models.Decoder(models.tiny_config("llama"), rngs=nnx.Rngs(0)), num_slots=1,
            cache_length=16, policy_temperature=0.0)
  # Read-only: compiled decode programs keep the temperature they were built with.
  sampler = Sampler(models.Decoder(models.tiny_config("llama"), rngs=nnx.Rngs(0)),
                    num_slots=1, cache_length=16, policy_temperature=1.5)
  assert sampler.policy_temperature == 1.5
  with pytest.raises(AttributeError):
    sampler.policy_temperature = 1.0


def test_sampled_logprobs_skip_the_second_normaliser_only_when_all_rows_are_raw():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, 50)), jnp.float32)
  want_raw = np.asarray(jax.nn.log_softmax(logits))
  for temperature, same in [((1.0, 1.0, 1.0), True), ((1.0, 0.5, 1.0), False)]:
    params = SamplingParams.make(3).replace(temperature=jnp.asarray(temperature))
    tokens, raw, sampled = jax.jit(sample)(jax.random.key(1), logits, params)
    np.testing.assert_allclose(raw, want_raw[np.arange(3), tokens], rtol=1e-6)
    scaled = np.asarray(jax.nn.log_softmax(logits / jnp.asarray(temperature)[:, None]))
    np.testing.assert_allclose(sampled, scaled[np.arange(3), tokens], rtol=1e-6)
    assert np.array_equal(sampled, raw) == same
  # The raw case compiles to a program without the second logsumexp branch taken.
  hlo = jax.jit(sample).lower(jax.random.key(1), logits, SamplingParams.make(3)).as_text()
  assert hlo.count("conditional") + hlo.count("stablehlo.case") >= 2


def test_a_remat_model_samples_like_the_plain_one(model, sampler):
  # Remat is a training choice (accelerator configs turn it on); the
  # sampler's cached steps run the layers plainly, so the same model samples.
  remat = models.Decoder(model.cfg.replace(remat=True), rngs=nnx.Rngs(0))
  nnx.update(remat, nnx.state(model, nnx.Param))
  other = Sampler(remat, num_slots=4, cache_length=CACHE, max_decode_length=12,
                  length_buckets=(8, 16))
  prompt = [3, 4, 5]
  got = [s.decode(s.prefill(s.init_state(), [0], [prompt]), [0], max_new_tokens=10,
                  temperature=0.0)[1][0].tokens for s in (other, sampler)]
  assert got[0] == got[1]
