"""token_logprobs vs the textbook log_softmax + gather, side by side.

  python benchmarks/token_logprobs.py [--batch 8 --length 1024 --vocab 32000]

Prints, for bf16 logits, the XLA temp memory each compiled function needs
(from the compiler's memory analysis) and its wall time (median of 10 runs,
value and gradient). The baseline casts the logits to float32 and
materialises log_softmax over the whole vocabulary, as the reference text's
PyTorch loss does.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from agentrl_jax import losses


def baseline(logits, tokens):
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(lp, ((0, 0), (1, 0)))


def measure(fn, logits, tokens):
  value_and_grad = jax.jit(jax.value_and_grad(lambda x: fn(x, tokens).sum()))
  compiled = value_and_grad.lower(logits).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  jax.block_until_ready(compiled(logits))
  times = []
  for _ in range(10):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(logits))
    times.append(time.perf_counter() - t0)
  return temp, statistics.median(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--vocab", type=int, default=32000)
  args = parser.parse_args()
  k1, k2 = jax.random.split(jax.random.key(0))
  shape = (args.batch, args.length, args.vocab)
  logits = jax.random.normal(k1, shape, jnp.bfloat16)
  tokens = jax.random.randint(k2, shape[:2], 0, args.vocab)
  got, want = losses.token_logprobs(logits, tokens), baseline(logits, tokens)
  err = float(jnp.max(jnp.abs(got - want)))
  print(f"{jax.devices()[0].platform}: bf16 logits {shape} "
        f"({logits.nbytes / 2**20:.0f} MiB); max |ours - baseline| = {err:.2e}")
  print(f"{'':>24} {'temp MiB':>9} {'ms (value+grad)':>16}")
  for name, fn in [("ours", losses.token_logprobs), ("log_softmax + gather", baseline)]:
    temp, sec = measure(fn, logits, tokens)
    print(f"{name:>24} {temp / 2**20:9.1f} {sec * 1e3:16.1f}")


if __name__ == "__main__":
  main()
