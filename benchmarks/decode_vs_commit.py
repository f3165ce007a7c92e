"""The model's cached decode step now against the same step at another commit.

  python benchmarks/decode_vs_commit.py [--rev HEAD] [--batch 16] [--rounds 9]

`agentrl_jax/models/decoder.py` as it is at `--rev` (`git show`) is loaded
as a module of its own beside today's (it imports today's config and
trajectory modules); each builds vs_tunix.py's goal size (Qwen2 shape, 4
layers, d = 512, 8 heads of 64, 2 KV heads, vocabulary 4096, float32) from
seed 0, must greedy-decode the same tokens, and has its cached step timed
as decode_parts.py times it (a `fori_loop` of 128 steps after a 16-token
prompt, argmax feeding the next token), interleaved rounds, medians. For a
change inside the decoder (the KV cache's layout, attention), that is the
baseline in the same process.

Last line: `rev_ms=... now_ms=... speedup=...` (ms a token; rev / now).
"""

import argparse
import importlib.util
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from agentrl_jax import models
from agentrl_jax.models import decoder
import common  # pylint: disable=wrong-import-order

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT, NEW = 16, 128


def decoder_at(rev: str):
  """agentrl_jax.models.decoder as it is at `rev`, as a fresh module."""
  source = subprocess.run(["git", "show", f"{rev}:agentrl_jax/models/decoder.py"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout
  path = pathlib.Path(tempfile.mkdtemp()) / "decoder_at_rev.py"
  path.write_text(source)
  spec = importlib.util.spec_from_file_location("decoder_at_rev", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while it runs
  spec.loader.exec_module(module)
  return module


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rev", default="HEAD")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--rounds", type=int, default=9)
  args = p.parse_args()
  cfg = models.tiny_config("qwen2", vocab_size=4096, hidden_size=512, intermediate_size=1024,
                           num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64)
  fns = [common.cached_steps(m, cfg, batch=args.batch, prompt=PROMPT, new_tokens=NEW)
         for m in (decoder_at(args.rev), decoder)]
  last = [np.asarray(fn()) for fn in fns]
  if not np.array_equal(*last):
    raise SystemExit(f"the two decoders disagree on the greedy tokens: {last}")
  rev_ms, now_ms = (1e3 * t / NEW for t in common.median_times(fns, repeats=args.rounds))
  print(f"batch {args.batch}, ms per token: {args.rev} {rev_ms:.2f}, now {now_ms:.2f}")
  print(f"rev_ms={rev_ms:.2f} now_ms={now_ms:.2f} speedup={rev_ms / now_ms:.3f}")


if __name__ == "__main__":
  main()
