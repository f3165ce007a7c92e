"""Sampler throughput, side by side with its baselines in one process.

  python benchmarks/sampler.py [--slots 16 --new_tokens 128 --turns 8]

1. Decode tokens/s: our jitted KV-cache decode vs transformers `generate`
   (PyTorch, KV cache on) on the same tiny Llama weights.
2. Ours with the cache vs a no-cache loop (a jitted full forward over the
   padded sequence for every new token: one compile, no KV reuse).
3. An agentic episode (T turns of A-token actions and O-token observations):
   `extend` (KV only for new tokens) vs re-prefilling the whole conversation
   every turn, as frameworks that re-render the chat do.
4. The same episode (extend) with decode attending over the default cache
   windows (S/4, S/2, S: the smallest that holds the contexts) vs always
   over the whole cache.
5. Stop strings matched on text (`sampling.stops`) at a real vocabulary
   size: a tiny Llama with the 151,665-id Qwen2.5 vocabulary decoding with
   8 stop strings plus EOS vs the same decode compiled with the automaton
   step removed, and the tables' memory. `--stops_only` runs just 5 and 6.
6. At that vocabulary: decode at temperature 1 (the sampled log-probs are
   the raw ones: no second normaliser over V) vs 0.999 (one program).

Timings are medians of 3 runs after a warm-up run that compiles everything
(in 4-6, the compared variants' runs alternate). The last line holds the
ratios as key=value (higher is better, stop_overhead a fraction).
"""

import argparse
import time

from common import llama_pair, median_time, median_times
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import torch

from agentrl_jax import models
from agentrl_jax import tokenizer as tok_lib
from agentrl_jax.sampling import Sampler, SamplingParams, sample, stops as stops_lib


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--prompt", type=int, default=16)
  p.add_argument("--new_tokens", type=int, default=128)
  p.add_argument("--turns", type=int, default=8)
  p.add_argument("--action", type=int, default=64)
  p.add_argument("--observation", type=int, default=128)
  p.add_argument("--stops_only", action="store_true")
  args = p.parse_args()
  if args.stops_only:
    print(" ".join(f"{k}={v:.3f}" for k, v in qwen_vocab_decode(args).items()))
    return
  b, n = args.slots, args.new_tokens

  tmodel, model = llama_pair()
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, 512, (b, args.prompt))
  print(f"{jax.devices()[0].platform}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); tiny Llama (2 layers, d=128, "
        f"vocab 512), {b} slots")

  # 1 and 2: plain decode of n tokens after a short prompt.
  sampler = Sampler(model, num_slots=b, cache_length=args.prompt + n,
                    max_decode_length=n, length_buckets=(args.prompt,))
  slots = list(range(b))

  def ours():
    state = sampler.prefill(sampler.init_state(), slots, prompts)
    _, actions = sampler.decode(state, slots, max_new_tokens=n)
    assert all(len(a.tokens) == n for a in actions.values())

  def hf_generate():
    with torch.no_grad():
      out = tmodel.generate(torch.tensor(prompts), attention_mask=torch.ones(
          (b, args.prompt), dtype=torch.long), do_sample=True, top_k=0,
          max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    assert out.shape[1] == args.prompt + n

  width = args.prompt + n
  params = SamplingParams.make(b)

  @nnx.jit
  def no_cache_step(model, ids, i, key):
    logits = jax.lax.dynamic_index_in_dim(model(ids), i - 1, axis=1, keepdims=False)
    return ids.at[:, i].set(sample(key, logits, params)[0])

  def no_cache():
    ids = np.zeros((b, width), np.int32)
    ids[:, :args.prompt] = prompts
    ids = jnp.asarray(ids)
    keys = jax.random.split(jax.random.key(0), width)
    for i in range(args.prompt, width):
      ids = no_cache_step(model, ids, jnp.int32(i), keys[i])
    jax.block_until_ready(ids)

  t_ours = median_time(ours, 3)
  t_hf = median_time(hf_generate, 3)
  t_nc = median_time(no_cache, 3)
  tok = b * n
  print(f"\ndecode {n} new tokens x {b} slots (incl. a {args.prompt}-token prefill):")
  print(f"  ours (KV cache, jitted loop)   {tok / t_ours:9.0f} tok/s")
  print(f"  transformers generate (torch)  {tok / t_hf:9.0f} tok/s   ours/theirs = {t_hf / t_ours:.2f}x")
  print(f"  ours without cache             {tok / t_nc:9.0f} tok/s   cache speed-up = {t_nc / t_ours:.1f}x")

  # 3: a T-turn episode, extend vs re-prefill.
  total = args.prompt + args.turns * (args.action + args.observation)
  buckets = tuple(sorted({args.prompt, args.observation, 256, 512, 1024, 2048, 4096}))
  kw = dict(num_slots=b, cache_length=total, max_decode_length=args.action,
            length_buckets=buckets)
  ep = Sampler(model, **kw)
  observations = rng.integers(0, 512, (args.turns, b, args.observation))

  def episode(reprefill, ep=ep):
    state = ep.prefill(ep.init_state(), slots, prompts)
    history = [list(p) for p in prompts]
    for t in range(args.turns):
      state, actions = ep.decode(state, slots, max_new_tokens=args.action)
      for s in slots:
        history[s] += actions[s].tokens + list(observations[t, s])
      if reprefill:  # what re-rendering frameworks do: the whole conversation
        state = ep.prefill(state, slots, history)
      else:
        state = ep.extend(state, slots, observations[t])
    jax.block_until_ready(state.next_logits)

  # 4: the same episode, decode attending over the whole cache every step;
  # its runs alternate with the windowed ones (the speed of this machine drifts).
  whole = Sampler(model, attention_windows=(total,), **kw)
  t_ext, t_whole = median_times([lambda: episode(False), lambda: episode(False, whole)], 3)
  t_re = median_time(lambda: episode(True), 3)
  print(f"\n{args.turns}-turn episode ({args.action}-token actions, "
        f"{args.observation}-token observations, {total} tokens per slot):")
  print(f"  extend (KV reuse)              {t_ext:7.2f} s")
  print(f"  re-prefill every turn          {t_re:7.2f} s   extend cost = {t_ext / t_re:.2f}x")
  print(f"  extend, decode over whole cache {t_whole:5.2f} s   "
        f"windows {ep.attention_windows} speed-up = {t_whole / t_ext:.2f}x")
  ratios = {"decode_vs_hf": t_hf / t_ours, "cache_vs_nocache": t_nc / t_ours,
            "extend_vs_reprefill": t_re / t_ext, "windows_vs_whole": t_whole / t_ext,
            **qwen_vocab_decode(args)}
  print(" ".join(f"{k}={v:.3f}" for k, v in ratios.items()))


def qwen_vocab_decode(args) -> dict[str, float]:
  """5: stops on text, Qwen2.5 vocabulary. The runs must decode every token
  (a stop hit by chance would shorten one): checked. 6: the sampled
  log-prob's second normaliser, skipped at temperature 1."""
  b, n, slots = args.slots, args.new_tokens, list(range(args.slots))
  vocab = 151665
  qwen = tok_lib.qwen2_tokenizer()
  tags = ["</search>", "</answer>", "</python>", "</submit>", "</move>", "</calc>",
          "</think>"]  # with ChatML's <|im_end|>: 8 strings, plus the EOS id
  t0 = time.perf_counter()
  matcher = tok_lib.CHATML.stop_matcher(qwen, extra=tags, vocab_size=vocab)
  t_build = time.perf_counter() - t0
  big = models.Decoder(models.tiny_config("llama", vocab_size=vocab), rngs=nnx.Rngs(0))
  kw = dict(num_slots=b, cache_length=args.prompt + n, max_decode_length=n,
            length_buckets=(args.prompt,))
  with_stops, without = Sampler(big, **kw), Sampler(big, **kw)
  prompts = np.random.default_rng(0).integers(0, 151643, (b, args.prompt))

  def decode_with(sampler):
    state = sampler.prefill(sampler.init_state(0), slots, prompts)
    _, actions = sampler.decode(state, slots, stops=matcher, max_new_tokens=n)
    assert all(len(a.tokens) == n for a in actions.values()), "a stop shortened a run"

  # The baseline's decode is traced with the automaton step as a no-op.
  real = stops_lib.advance
  stops_lib.advance = lambda tables, state, tokens: (state, jnp.zeros(tokens.shape, bool))
  try:
    decode_with(without)
  finally:
    stops_lib.advance = real
  t_none, t_stops = median_times([lambda: decode_with(without),
                                  lambda: decode_with(with_stops)], 5)
  tables = matcher.tables(with_stops.max_stop_states, with_stops.max_stop_classes, vocab)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(tables))
  print(f"\nstops on text, vocab {vocab} (tiny Llama, d=128), {b} slots, {n} new "
        f"tokens, {len(tags) + 1} stop strings + EOS: {matcher.num_states} states, "
        f"{matcher.num_classes} token classes, tables {nbytes / 2**20:.2f} MiB (padded "
        f"to {with_stops.max_stop_states} x {with_stops.max_stop_classes}), built in "
        f"{t_build:.1f} s")
  print(f"  decode, no stop step           {b * n / t_none:9.0f} tok/s")
  print(f"  decode with the stops          {b * n / t_stops:9.0f} tok/s   "
        f"overhead = {100 * (t_stops / t_none - 1):+.1f}%")

  # 6: one program; at temperature 1 every row samples the raw policy and the
  # second logsumexp over V is skipped, at 0.999 it runs.
  def decode_at(temperature):
    state = without.prefill(without.init_state(0), slots, prompts)
    jax.block_until_ready(without.decode(state, slots, max_new_tokens=n,
                                         temperature=temperature)[0].next_logits)

  decode_at(0.999)
  t_raw, t_scaled = median_times([lambda: decode_at(1.0), lambda: decode_at(0.999)], 5)
  print(f"  decode at T = 1 (raw log-probs reused)  {b * n / t_raw:9.0f} tok/s   "
        f"vs T = 0.999: {t_scaled / t_raw:.3f}x")
  return {"stop_overhead": t_stops / t_none - 1, "raw_vs_scaled_decode": t_scaled / t_raw}


if __name__ == "__main__":
  main()
