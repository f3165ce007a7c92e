"""What XLA allocates for the RL train step of a Qwen2.5-0.5B-wide model, by depth.

  python benchmarks/step_memory.py [--layers 2,4,8] [--rows 4] [--length 1024]
      [--micro-batches 1] [--no-remat]

Compiles `train.RLStep`'s programs (KL reference and behaviour forward on,
as in experiments/configs/qwen_tpu.py) on abstract inputs only
(`jax.eval_shape` state, ShapeDtypeStruct batch: nothing is allocated) and
prints XLA's buffer assignment: the step's arguments (the donated state)
and temporaries, the memory the step needs on top of its state, and the
temporaries of the reference's forward, which runs before it (the larger
of the two sets the peak). The per-layer figures are the step's. The width, vocabulary and
dtypes are Qwen2.5-0.5B's (bf16 compute, float32 masters); only the depth
varies, so the per-layer growth of the temporaries reads off the table and
extrapolates to 24 layers. The figures are the backend's (run it on the
machine you size for). The last line is `temp_gib_per_layer=... ...`.
"""

import argparse
import time

from flax import nnx
import jax
import jax.numpy as jnp

from agentrl_jax import models, train
from agentrl_jax.trajectory import abstract_batch

GIB = 2**30


def qwen_05b_width(layers: int, remat: bool) -> models.ModelConfig:
  return models.ModelConfig(
      arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
      num_layers=layers, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6,
      tie_word_embeddings=True, qkv_bias=True, dtype=jnp.bfloat16,
      param_dtype=jnp.float32, remat=remat)


def step_memory(cfg, rows: int, length: int, micro_batches: int) -> dict[str, float]:
  """GiB of the compiled step's arguments and temporaries, and compile seconds."""
  tx = train.make_optimizer(train.OptimConfig(learning_rate=1e-6))
  abstract_model = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef = nnx.split(abstract_model, nnx.Param)[0]
  state = jax.eval_shape(lambda: train.init_train_state(
      models.Decoder(cfg, rngs=nnx.Rngs(0)), tx, with_reference=True)[1])
  batch = abstract_batch(rows, length)
  step = train.RLStep(graphdef, tx, train.LossConfig(kl_beta=0.01,
                                                     micro_batches=micro_batches))
  t0 = time.perf_counter()
  # 64 action positions a row: the head's share stays small, as in agentic batches.
  info = {name: p.compile().memory_analysis()
          for name, p in step.lower(state, batch, 64).items()}
  return {"arguments": info["step"].argument_size_in_bytes / GIB,
          "temp": info["step"].temp_size_in_bytes / GIB,
          "reference_temp": info["reference"].temp_size_in_bytes / GIB,
          "compile_s": time.perf_counter() - t0}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", default="2,4,8")
  p.add_argument("--rows", type=int, default=4)
  p.add_argument("--length", type=int, default=1024)
  p.add_argument("--micro-batches", type=int, default=1)
  p.add_argument("--no-remat", action="store_true")
  args = p.parse_args()
  depths = [int(n) for n in args.layers.split(",")]
  print(f"{args.rows} rows x {args.length} tokens, micro_batches={args.micro_batches}, "
        f"remat={not args.no_remat}, {jax.devices()[0].platform}")
  print("| layers | state (arguments) GiB | step temporaries GiB | reference's GiB | compile s |"
        "\n|---|---|---|---|---|")
  temps = []
  for n in depths:
    m = step_memory(qwen_05b_width(n, not args.no_remat), args.rows, args.length,
                    args.micro_batches)
    temps.append(m["temp"])
    print(f"| {n} | {m['arguments']:.2f} | {m['temp']:.2f} | {m['reference_temp']:.2f} "
          f"| {m['compile_s']:.0f} |")
  per_layer = (temps[-1] - temps[0]) / max(depths[-1] - depths[0], 1)
  print(f"temp_gib_per_layer={per_layer:.3f} "
        f"temp_gib_at_24_layers={temps[-1] + per_layer * (24 - depths[-1]):.2f}")


if __name__ == "__main__":
  main()
