"""Shared by the benchmark scripts: one tiny model in both frameworks, timing."""

import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flax import nnx
import jax
import jax.numpy as jnp
import torch
import transformers

from agentrl_jax import models


def llama_pair(*, layers=2, hidden=128, vocab=512, seed=0):
  """(transformers LlamaForCausalLM, our Decoder) with the same random weights."""
  heads = max(hidden // 32, 1)
  hf = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
      num_hidden_layers=layers, num_attention_heads=heads,
      num_key_value_heads=max(heads // 2, 1), max_position_embeddings=4096)
  torch.manual_seed(seed)
  torch_model = transformers.LlamaForCausalLM(hf)
  with tempfile.TemporaryDirectory() as d:
    torch_model.save_pretrained(d)
    ours = models.from_pretrained(d)
  return torch_model, ours


def torch_token_logprobs(model, tokens):
  """[B, L - 1] float32 log-probs of tokens[:, 1:] under a transformers model."""
  logits = model(input_ids=tokens).logits
  return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]


def median_time(fn, repeats=5):
  """Median wall seconds of `fn()` over `repeats` runs after one warm-up."""
  return median_times([fn], repeats)[0]


def median_times(fns, repeats=5):
  """Median wall seconds of each fn over `repeats` rounds that run them in
  turn (after one warm-up each): a drift in machine speed hits all alike."""
  for fn in fns:
    fn()
  times = [[] for _ in fns]
  for _ in range(repeats):
    for fn, t in zip(fns, times):
      t0 = time.perf_counter()
      fn()
      t.append(time.perf_counter() - t0)
  return [statistics.median(t) for t in times]


def dense_floor(*, layers, hidden, intermediate, q_width, kv_width, vocab, batch,
                new_tokens):
  """A decode's least cost: `new_tokens` steps of only a decoder's weight
  matmuls on [batch, hidden] rows (the attention projections, the MLP, the
  LM head and one max over its logits); no attention over a cache, no
  sampling, no bookkeeping. Returns a function that runs them once."""
  d, f = hidden, intermediate
  shapes = [(d, q_width), (d, kv_width), (d, kv_width), (q_width, d), (d, f), (d, f),
            (f, d)] * layers
  keys = jax.random.split(jax.random.key(0), len(shapes) + 2)
  ws = [0.02 * jax.random.normal(k, s) for k, s in zip(keys, shapes + [(d, vocab)])]
  x0 = jax.random.normal(keys[-1], (batch, d))

  @jax.jit
  def steps(ws, x):
    def body(_, x):
      for layer in range(layers):
        wq, wk, wv, wo, wg, wu, wd = ws[7 * layer:7 * layer + 7]
        kv_sum = jnp.sum(x @ wk) + jnp.sum(x @ wv)  # computed, as a decode must
        x = x + (x @ wq) @ wo + 1e-9 * kv_sum
        x = x + (jax.nn.silu(x @ wg) * (x @ wu)) @ wd
      return x + 1e-6 * jnp.max(x @ ws[-1], axis=-1, keepdims=True)
    return jax.lax.fori_loop(0, new_tokens, body, x)

  return lambda: jax.block_until_ready(steps(ws, x0))


def cached_steps(decoder_module, cfg, *, batch, prompt, new_tokens):
  """The model's cached decode step alone: `decoder_module.Decoder` (seed 0)
  writes `new_tokens` tokens into a fresh `decoder_module.KVCache` after
  position `prompt`, argmax feeding the next token; no sampler. Returns a
  function that runs them once and returns the [batch] last tokens."""
  graphdef, params = nnx.split(decoder_module.Decoder(cfg, rngs=nnx.Rngs(0)))
  b, n = batch, new_tokens

  @jax.jit
  def steps(params, token):
    m = nnx.merge(graphdef, params)

    def body(i, carry):
      cache, token = carry
      hidden, cache = m.hidden_states(token[:, None], jnp.full((b, 1), prompt + i, jnp.int32),
                                      cache=cache)
      return cache, jnp.argmax(m.logits(hidden[:, 0]), -1).astype(jnp.int32)
    cache = decoder_module.KVCache.zeros(cfg, b, prompt + n)
    return jax.lax.fori_loop(0, n, body, (cache, token))[1]

  token0 = jnp.zeros(b, jnp.int32)
  return lambda: jax.block_until_ready(steps(params, token0))
