"""Where a decode step's time goes: the sampler against the model's step alone.

  python benchmarks/decode_parts.py [--batch 64] [--new_tokens 128]

At vs_tunix.py's goal size (Qwen2 shape, 4 layers, d = 512, 8 heads of 64,
2 KV heads, vocabulary 4096, float32), one process, interleaved rounds
(medians), ms per new token:
- `Sampler.decode` at T = 1 and greedy (T = 0): the whole jitted loop
  (sampling, raw log-probs, the stop automaton, the output buffers, the
  sub-batch gather and scatter of the cache);
- the model's cached step alone in a `fori_loop` (embedding, norms, RoPE,
  the cache update, attention over the cache, the LM head), argmax feeding
  the next token;
- its dense matmuls alone (`common.dense_floor`, no cache).

Then one draw from [batch, 151936] log-probs (Qwen's vocabulary):
`jax.random.categorical` (Gumbel-max, a random number per token) against
`sampling.processing.draw` (two-level inverse CDF, two a row), each with
the raw log-prob's normaliser.

Last line: `sampler_ms=... model_step_ms=... dense_ms=... gumbel_draw_ms=... draw_ms=...`.
"""

import argparse
import statistics
import time

from flax import nnx
import jax
import numpy as np

from agentrl_jax import models
from agentrl_jax.models import decoder
from agentrl_jax.sampling import Sampler, processing
import common  # pylint: disable=wrong-import-order

PROMPT = 16
QWEN_VOCAB = 151936


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--new_tokens", type=int, default=128)
  p.add_argument("--rounds", type=int, default=5)
  args = p.parse_args()
  b, n = args.batch, args.new_tokens
  cfg = models.tiny_config("qwen2", vocab_size=4096, hidden_size=512, intermediate_size=1024,
                           num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64)
  model = models.Decoder(cfg, rngs=nnx.Rngs(0))
  sampler = Sampler(model, num_slots=b, cache_length=PROMPT + n, max_decode_length=n,
                    length_buckets=(PROMPT,))
  slots = list(range(b))
  prompts = [np.random.RandomState(i).randint(0, cfg.vocab_size, PROMPT).tolist()
             for i in range(b)]

  def decode(temperature):
    def run():
      state = sampler.prefill(sampler.init_state(0), slots, prompts)
      state, _ = sampler.decode(state, slots, max_new_tokens=n, temperature=temperature)
      jax.block_until_ready(state.lengths)
    return run

  fns = {"Sampler.decode, T = 1": decode(1.0), "Sampler.decode, greedy": decode(0.0),
         "the model's cached step + argmax": common.cached_steps(
             decoder, cfg, batch=b, prompt=PROMPT, new_tokens=n),
         "its dense matmuls alone": common.dense_floor(
             layers=cfg.num_layers, hidden=cfg.hidden_size,
             intermediate=cfg.intermediate_size, q_width=cfg.num_heads * cfg.head_dim,
             kv_width=cfg.num_kv_heads * cfg.head_dim, vocab=cfg.vocab_size, batch=b,
             new_tokens=n)}
  for fn in fns.values():
    fn()
  times = {k: [] for k in fns}
  for _ in range(args.rounds):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      times[k].append(time.perf_counter() - t0)
  ms = {k: 1e3 * statistics.median(t) / n for k, t in times.items()}
  print(f"batch {b}, {n} new tokens, ms per token:")
  for k, v in ms.items():
    print(f"  {k}: {v:.2f}")
  sampler_ms, model_ms, dense_ms = (ms["Sampler.decode, T = 1"],
                                    ms["the model's cached step + argmax"],
                                    ms["its dense matmuls alone"])
  gumbel_ms, draw_ms = _draw_at_qwen_vocabulary(b, args.rounds)
  print(f"one draw from [{b}, {QWEN_VOCAB}] log-probs, ms: Gumbel-max {gumbel_ms:.2f}, "
        f"two-level inverse CDF {draw_ms:.2f}")
  print(f"sampler_ms={sampler_ms:.2f} model_step_ms={model_ms:.2f} dense_ms={dense_ms:.2f} "
        f"gumbel_draw_ms={gumbel_ms:.2f} draw_ms={draw_ms:.2f}")


def _draw_at_qwen_vocabulary(b, rounds):
  logits = 3.0 * jax.random.normal(jax.random.key(1), (b, QWEN_VOCAB))
  gumbel = jax.jit(lambda key, x: (jax.random.categorical(key, x, axis=-1),
                                   jax.nn.logsumexp(x, axis=-1)))

  @jax.jit
  def two_level(key, x):
    logp = x - jax.nn.logsumexp(x, axis=-1, keepdims=True)
    return processing.draw(jax.random.uniform(key, (b, 2)), logp), logp[:, 0]

  fns = (gumbel, two_level)
  times = [[], []]
  for i in range(rounds + 1):  # round 0 compiles
    for fn, t in zip(fns, times):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(jax.random.key(i), logits))
      if i:
        t.append(time.perf_counter() - t0)
  return tuple(1e3 * statistics.median(t) for t in times)


if __name__ == "__main__":
  main()
