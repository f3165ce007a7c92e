"""Forward and forward+backward tokens/s: our NNX decoder vs transformers (PyTorch).

  python benchmarks/forward.py [--batch 16 --length 256 --layers 2 --hidden 128]

Both run the same random Llama weights (built in transformers, saved, loaded
by `from_pretrained`) on the same batch, in float32, one process, median of
5 timed runs after warm-up. Backward is the gradient of the summed
log-probs of the tokens w.r.t. all parameters.
"""

import argparse

from common import llama_pair, median_time, torch_token_logprobs
from flax import nnx
import jax
import numpy as np
import torch

from agentrl_jax import losses


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--length", type=int, default=256)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--vocab", type=int, default=512)
  args = p.parse_args()
  tmodel, model = llama_pair(layers=args.layers, hidden=args.hidden, vocab=args.vocab)
  tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.length))
  n_tokens = tokens.size
  jtokens = jax.numpy.asarray(tokens)
  ttokens = torch.tensor(tokens)

  fwd = nnx.jit(lambda m, t: m(t))
  loss = lambda m, t: losses.token_logprobs(m(t), t).sum()
  grad = nnx.jit(nnx.grad(loss))

  def torch_fwd():
    with torch.no_grad():
      tmodel(input_ids=ttokens).logits.sum().item()

  def torch_bwd():
    tmodel.zero_grad()
    torch_token_logprobs(tmodel, ttokens).sum().backward()

  rows = [
      ("forward", lambda: jax.block_until_ready(fwd(model, jtokens)), torch_fwd),
      ("forward+backward", lambda: jax.block_until_ready(grad(model, jtokens)),
       torch_bwd),
  ]
  print(f"{jax.devices()[0].platform} / torch {torch.__version__} "
        f"({torch.get_num_threads()} threads): Llama {args.layers} layers, "
        f"d={args.hidden}, vocab {args.vocab}, batch {args.batch} x {args.length}")
  print(f"{'':>18} {'ours tok/s':>12} {'torch tok/s':>12} {'ratio':>7}")
  for name, ours, theirs in rows:
    a, b = n_tokens / median_time(ours), n_tokens / median_time(theirs)
    print(f"{name:>18} {a:12.0f} {b:12.0f} {a / b:7.2f}")


if __name__ == "__main__":
  main()
