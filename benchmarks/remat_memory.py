"""Does remat save memory on this backend? jax.checkpoint and models.decoder.remat,
over unrolled layers and a layer scan.

  python benchmarks/remat_memory.py

A stack of residual MLP layers (d = 896, F = 4864: Qwen2.5-0.5B's MLP, 4096
tokens, float32), its gradient compiled on abstract inputs (nothing is
allocated), and XLA's temporaries read from the buffer assignment: layers
unrolled in Python (as `models.Decoder` runs them) or under `lax.scan`,
each plain, under `jax.checkpoint` and under `decoder.remat` (what the
decoder's `remat=True` uses). Remat should cut the growth per layer from the
saved activations (4096 x 4864 x 4 B = 76 MiB) to the layer's input. The
last line is `<layout>_<remat>_gib_per_layer=...`.
"""

import jax
import jax.numpy as jnp

from agentrl_jax.models import decoder

GIB = 2**30
D, F, TOKENS = 896, 4864, 4096


def _layer(w, x):
  return x + jnp.tanh(x @ w[0]) @ w[1]


REMATS = {"plain": _layer, "checkpoint": jax.checkpoint(_layer),
          "decoder_remat": decoder.remat(_layer)}


def temp_gib(layers: int, scan: bool, remat: str) -> float:
  """XLA's temporaries of the stack's gradient, in GiB."""
  step = REMATS[remat]
  x = jax.ShapeDtypeStruct((TOKENS, D), jnp.float32)
  if scan:
    ws = (jax.ShapeDtypeStruct((layers, D, F), jnp.float32),
          jax.ShapeDtypeStruct((layers, F, D), jnp.float32))

    def loss(ws, x):
      return jnp.sum(jax.lax.scan(lambda h, w: (step(w, h), None), x, ws)[0] ** 2)
  else:
    ws = [(jax.ShapeDtypeStruct((D, F), jnp.float32),
           jax.ShapeDtypeStruct((F, D), jnp.float32)) for _ in range(layers)]

    def loss(ws, x):
      for w in ws:
        x = step(w, x)
      return jnp.sum(x ** 2)
  compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes / GIB


def main():
  print(f"{jax.devices()[0].platform}: gradient temporaries (GiB) of residual MLP layers")
  print("| layout | remat | 4 layers | 8 layers | per layer |\n|---|---|---|---|---|")
  pairs = []
  for scan in (False, True):
    for remat in REMATS:
      four, eight = temp_gib(4, scan, remat), temp_gib(8, scan, remat)
      layout = "scan" if scan else "unrolled"
      print(f"| {layout} | {remat} | {four:.2f} | {eight:.2f} | {(eight - four) / 4:.3f} |")
      pairs.append(f"{layout}_{remat}_gib_per_layer="
                   f"{(eight - four) / 4:.3f}")
  print(" ".join(pairs))


if __name__ == "__main__":
  main()
