"""RL train step on 1, 2, 4, 8 simulated CPU devices (and MFU on a GPU).

  python benchmarks/scaling.py [--devices 1,2,4,8 --mesh data|fsdp
                                --batch 16 --length 128]
  python benchmarks/scaling.py --peak-tflops 989  # on a GPU: adds an MFU run

A correctness-of-scaling sanity check on CPU, not a speed claim. Each device
count runs in its own subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=N, so the N "devices" share
the same CPU cores: more of them cannot be faster, and partitioning and
collectives add overhead. What the table shows is that `train.RLStep(...,
mesh=...)` compiles and runs on every mesh, at what cost, and with the same
first-step loss as on one device.

Step: `train.RLStep` (token-mean clipped surrogate, k3 KL to a frozen
reference, AdamW) on a tiny Llama (2 layers, d=128, vocab 512), state
sharded by `sharding.PARTITION_RULES` on a `--mesh data` (pure data
parallel) or `--mesh fsdp` mesh of N devices, batch rows split over them;
median seconds per step after a compiling warm-up.

When the default jax device is a GPU, one more run on it (no mesh) with a
bigger bf16 model (`--gpu-layers`, `--gpu-hidden`, vocab 32000) reports MFU =
6 x params x tokens per step / step time / peak FLOP/s (`--peak-tflops`).
6 x params counts the forward and backward of the policy only, not the
step's two no-grad forwards (behaviour and reference log-probs) nor
attention's quadratic term, so it understates the FLOPs done.

The last line is `devices=1,2,4,8 tokens_per_s=a,b,c,d`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax import models, sharding, train
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate


def random_batch(rng, batch, length, vocab):
  """`batch` trajectories of exactly `length` tokens, a quarter prompt."""
  trajs = []
  for _ in range(batch):
    prompt = length // 4
    segs = [Segment(Role.SYSTEM, rng.integers(0, vocab, prompt)),
            Segment(Role.ASSISTANT, rng.integers(0, vocab, length - prompt),
                    -rng.uniform(3, 7, length - prompt))]
    trajs.append(Trajectory(segs, reward=float(rng.uniform())))
  b = collate(trajs, buckets=(length,), num_rows=batch)
  return b.replace(advantages=b.loss_mask * rng.normal(size=b.loss_mask.shape)
                   .astype(np.float32))


def measure(cfg, mesh, batch, length, repeats):
  """Times RLStep; returns a dict of step seconds, tokens/s, first loss..."""
  model = models.Decoder(cfg, rngs=nnx.Rngs(0))
  tx = train.make_optimizer(train.OptimConfig(learning_rate=1e-5, warmup_steps=1))
  graphdef, state = train.init_train_state(model, tx, with_reference=True)
  step = train.RLStep(graphdef, tx, train.LossConfig(kl_beta=0.02), mesh=mesh)
  data = random_batch(np.random.default_rng(0), batch, length, cfg.vocab_size)
  t0 = time.perf_counter()
  state, metrics = step(state, data)
  loss = float(metrics["loss"])  # waits for the compiling first step
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state, metrics = step(state, data)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  params = sum(x.size for x in jax.tree.leaves(state.params))
  return dict(step_s=step_s, tokens_per_s=batch * length / step_s, loss=loss,
              compile_s=compile_s, params=params)


def worker(args):
  """One device count, in a process started with the XLA device-count flag."""
  n = jax.device_count()
  mesh = sharding.make_mesh(sharding.MeshConfig(**{args.mesh: n}))
  result = measure(models.tiny_config("llama"), mesh, args.batch, args.length,
                   args.repeats)
  print(json.dumps(dict(devices=n, **result)))


def gpu_mfu(args):
  cfg = models.tiny_config(
      "llama", vocab_size=32000, hidden_size=args.gpu_hidden,
      intermediate_size=4 * args.gpu_hidden, num_layers=args.gpu_layers,
      num_heads=args.gpu_hidden // 128, num_kv_heads=args.gpu_hidden // 512,
      head_dim=128, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  r = measure(cfg, None, args.gpu_batch, args.gpu_length, args.repeats)
  tokens = args.gpu_batch * args.gpu_length
  print(f"\n{jax.devices()[0].device_kind}: {r['params'] / 1e6:.0f}M params bf16, "
        f"batch {args.gpu_batch} x {args.gpu_length}, RL step with KL: "
        f"{r['step_s'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tok/s")
  if args.peak_tflops:
    mfu = 6 * r["params"] * tokens / r["step_s"] / (args.peak_tflops * 1e12)
    print(f"  MFU (6 x params x tokens, peak {args.peak_tflops} TFLOP/s): {mfu:.1%}")
  else:
    print("  pass --peak-tflops for MFU")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--devices", default="1,2,4,8")
  p.add_argument("--mesh", choices=("data", "fsdp"), default="data")
  p.add_argument("--batch", type=int, default=16)  # rows; divisible by every N
  p.add_argument("--length", type=int, default=128)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--peak-tflops", type=float, default=None)
  p.add_argument("--gpu-layers", type=int, default=12)
  p.add_argument("--gpu-hidden", type=int, default=1024)
  p.add_argument("--gpu-batch", type=int, default=16)
  p.add_argument("--gpu-length", type=int, default=1024)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    return worker(args)

  counts = [int(n) for n in args.devices.split(",")]
  rows = []
  for n in counts:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"))
    out = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env,
                         capture_output=True, text=True, check=True)
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  print(f"cpu ({os.cpu_count()} cores), tiny Llama ({rows[0]['params'] / 1e6:.2f}M params), "
        f"batch {args.batch} x {args.length}, RL step with KL, {args.mesh} mesh:")
  print("| devices | step ms | tokens/s | vs 1 device | compile s | first loss | |loss - 1 dev| |")
  print("|---|---|---|---|---|---|---|")
  base = rows[0]
  for r in rows:
    print(f"| {r['devices']} | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:,.0f} | "
          f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['compile_s']:.1f} | "
          f"{r['loss']:.6f} | {abs(r['loss'] - base['loss']):.1e} |")
  if jax.devices()[0].platform == "gpu":
    gpu_mfu(args)
  print(f"devices={','.join(str(r['devices']) for r in rows)} tokens_per_s="
        + ",".join(f"{r['tokens_per_s']:.0f}" for r in rows))


if __name__ == "__main__":
  main()
