"""Train-step throughput and peak memory vs PyTorch eager, and recompilations.

  python benchmarks/train_step.py [--sizes tiny,qwenvocab --iterations 50] [--lora 8]

Two sizes, each on the same random weights and batch in both frameworks:
  tiny       2 layers, d = 128, vocab 512, batch 16 x 256, 75% action tokens
  qwenvocab  4 layers, d = 256, vocab 151,665 (Qwen2.5's), batch 16 x 512,
             15% action tokens in 4 turns (an agentic batch: mostly observations)

Ours: `train.RLStep` (token-mean clipped surrogate, k3 KL to a frozen
reference with beta 0.02, AdamW, global-norm clipping), jitted, state
donated; timed with `behaviour_forward=False`, the baseline's work (it takes
the sampler's log-probs as the behaviour ones), and with the default (the
entropy and sampler-vs-trainer gap metrics). Baseline: the reference text's
`agentic_grpo_step` loss (shifted masked clipped surrogate + k3 KL,
reference forward under no_grad) on transformers' PyTorch
`LlamaForCausalLM` with the same config, batch, optimizer and clipping,
eager. Both: median seconds per step of 5 after a warm-up.

Peak memory of a step, state included (params, reference, Adam moments,
batch): ours from XLA's compiled memory stats (arguments + outputs + temps
- donated aliases); torch's as the state's tensor bytes (the gradients
included: they stay from one step to the next) plus the rise of the peak
resident memory over one step (Linux VmHWM, reset before the step), in a
fresh process that gives every tensor of 1 MiB or more its own pages
(`torch_peak`); the CPU allocator keeps no peak statistic of its own.

With `--lora R`, ours also runs the same step with rank-R LoRA adapters on
every linear (`models.lora`; the base frozen, in its own bf16-or-float32
copy), timed in the same rounds; its line gives the trained parameters and
peak memory next to full fine-tuning's.

Then `iterations` RL steps of the tiny size on freshly collated batches of
random lengths (two length buckets, compiled in warm-up) count how many new
compilations happen (goal: none). The last line is
`step_vs_torch_tiny=X step_vs_torch_qwenvocab=Y peak_mem_vs_torch_qwenvocab=Z
recompiles=N` (like-for-like: behaviour forward off).
"""

import argparse
import copy
import dataclasses
import os
import re
import subprocess
import sys

from common import llama_pair, median_times, torch_token_logprobs
from flax import nnx
import jax
import numpy as np
import torch

from agentrl_jax import losses, models, train
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate

BETA, EPS = 0.02, 0.2


@dataclasses.dataclass(frozen=True)
class Size:
  layers: int
  hidden: int
  vocab: int
  batch: int
  length: int
  action_frac: float
  turns: int


SIZES = {"tiny": Size(2, 128, 512, 16, 256, 0.75, 1),
         "qwenvocab": Size(4, 256, 151_665, 16, 512, 0.15, 4)}


def random_batch(rng, size: Size, lengths, bucket):
  """Rows of `turns` (observation, action) pairs; the first observation is
  the system prompt and `action_frac` of each pair is the action."""
  trajs = []
  for n in lengths:
    segs = []
    for t in range(size.turns):
      chunk = n // size.turns + (t < n % size.turns)
      obs = max(round(chunk * (1 - size.action_frac)), 1)
      segs += [Segment(Role.SYSTEM if t == 0 else Role.OBSERVATION,
                       rng.integers(0, size.vocab, obs)),
               Segment(Role.ASSISTANT, rng.integers(0, size.vocab, chunk - obs),
                       -rng.uniform(3, 7, chunk - obs))]
    trajs.append(Trajectory(segs, reward=float(rng.uniform())))
  b = collate(trajs, buckets=bucket, num_rows=size.batch)
  return b.replace(advantages=b.loss_mask * rng.normal(size=b.loss_mask.shape).astype(np.float32))


def torch_step(policy, ref, opt, tokens, mask, adv, old):
  """The reference text's agentic_grpo_step loss, on one prepared batch.

  Ordered as a careful eager user would to fit memory (at the Qwen vocabulary
  one [16, 511, V] float32 array is 5 GB): the reference log-probs first,
  their logits freed on return, and no name kept on the policy's logits, so
  autograd holds only the log-softmax its backward needs.
  """
  with torch.no_grad():
    rlp = torch_token_logprobs(ref, tokens)
  logp = torch_token_logprobs(policy, tokens)
  m, a, o = mask[:, 1:], adv[:, 1:], old[:, 1:]
  ratio = torch.exp(logp - o)
  pg = -torch.min(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
  pg = (pg * m).sum() / m.sum().clamp(min=1.0)
  diff = rlp - logp
  kl = ((torch.exp(diff) - diff - 1.0) * m).sum() / m.sum().clamp(min=1.0)
  loss = pg + BETA * kl
  opt.zero_grad()
  loss.backward()
  torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
  opt.step()


def _vm(key: str) -> int:
  """This process's /proc/self/status figure `key`, in bytes."""
  status = open("/proc/self/status", encoding="ascii").read()
  return int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) * 1024


def torch_peak_rise(fn) -> int:
  """Bytes the process's peak resident memory rises over one `fn()` (run
  under MALLOC_MMAP_THRESHOLD_: see `torch_peak`)."""
  with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
    f.write("5")  # resets VmHWM to the current resident size
  before = _vm("VmRSS")
  fn()
  return _vm("VmHWM") - before


def torch_peak(name: str) -> int:
  """Peak bytes of one torch step of size `name`, state included, measured
  in a fresh process whose every allocation of 1 MiB or more gets its own
  pages and gives them back when freed (glibc's fixed mmap threshold): else
  freed tensors stay in the heap and a step's peak hides in memory that is
  already resident. Torch's CPU allocator keeps no peak statistic."""
  env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
  out = subprocess.run([sys.executable, __file__, "--torch-peak-of", name], env=env,
                       capture_output=True, text=True, check=True).stdout
  return int(out.split()[-1])


def _torch_peak_here(name: str) -> int:
  size = SIZES[name]
  tpolicy, _ = llama_pair(layers=size.layers, hidden=size.hidden, vocab=size.vocab)
  tref = copy.deepcopy(tpolicy).eval()
  batch = random_batch(np.random.default_rng(0), size, [size.length] * size.batch,
                       (size.length,))
  opt = torch.optim.AdamW(tpolicy.parameters(), lr=1e-5, weight_decay=0.0)
  tb = _torch_batch(batch)
  torch_step(tpolicy, tref, opt, *tb)  # creates the gradients and Adam moments
  return (tensor_bytes(tpolicy, tref, opt) + sum(t.numel() * t.element_size() for t in tb)
          + torch_peak_rise(lambda: torch_step(tpolicy, tref, opt, *tb)))


def _torch_batch(batch):
  return [torch.tensor(np.asarray(x)) for x in
          (batch.tokens.astype(np.int64), batch.loss_mask, batch.advantages, batch.old_logprobs)]


def xla_peak(step, state, batch, num_actions) -> int:
  """Bytes live at once in the step's compiled programs, their arguments
  included: the larger of the KL reference's and the step's (`RLStep.lower`;
  they run one after the other)."""
  def peak(m):
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
  return max(peak(p.compile().memory_analysis())
             for p in step.lower(state, batch, num_actions).values())


def tensor_bytes(*modules_or_opt) -> int:
  """Bytes of the parameters and gradients of modules, the state of optimizers."""
  seen, total = set(), 0
  for x in modules_or_opt:
    tensors = ([t for p in x.parameters() for t in (p, p.grad) if t is not None]
               if isinstance(x, torch.nn.Module) else
               [t for s in x.state.values() for t in s.values() if torch.is_tensor(t)])
    for t in tensors:
      if t.data_ptr() not in seen:
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
  return total


def compare(name: str, size: Size, rng, lora_rank: int = 0):
  """Times one size and prints its table (with a rank-`lora_rank` LoRA step
  when > 0); returns the like-for-like speed ratio, our peak memory, the
  lean step and its state."""
  tpolicy, model = llama_pair(layers=size.layers, hidden=size.hidden, vocab=size.vocab)
  tref = copy.deepcopy(tpolicy).eval()
  bucket = (size.length,)
  batch = random_batch(rng, size, [size.length] * size.batch, bucket)
  tokens = batch.tokens.shape[0] * batch.tokens.shape[1]
  num_actions = losses.action_bucket(losses.most_actions(batch.loss_mask), size.length)

  tx = train.make_optimizer(train.OptimConfig(learning_rate=1e-5, warmup_steps=1))
  graphdef, state0 = train.init_train_state(model, tx, with_reference=True)
  steps, states = {}, {}
  for behaviour in (False, True):
    steps[behaviour] = train.RLStep(graphdef, tx, train.LossConfig(
        clip_low=EPS, clip_high=EPS, kl_beta=BETA, behaviour_forward=behaviour))
    states[behaviour] = jax.tree.map(lambda x: x.copy(), state0)
  del state0
  if lora_rank:  # the adapters go on the model the states were copied from
    models.add_adapters(model, models.LoraConfig(rank=lora_rank), nnx.Rngs(1))
    lora_graphdef, states["lora"] = train.init_train_state(model, tx, with_reference=True)
    steps["lora"] = train.RLStep(lora_graphdef, tx, train.LossConfig(
        clip_low=EPS, clip_high=EPS, kl_beta=BETA, behaviour_forward=False))
  del model

  def ours(behaviour):
    def run():
      states[behaviour], metrics = steps[behaviour](states[behaviour], batch)
      jax.block_until_ready(metrics)
    return run

  opt = torch.optim.AdamW(tpolicy.parameters(), lr=1e-5, weight_decay=0.0)
  tb = _torch_batch(batch)
  run_torch = lambda: torch_step(tpolicy, tref, opt, *tb)
  times = median_times([ours(False), ours(True), run_torch]
                       + ([ours("lora")] if lora_rank else []))
  t_lean, t_default, t_torch = times[:3]

  mem_ours = xla_peak(steps[False], states[False], batch, num_actions)
  mem_default = xla_peak(steps[True], states[True], batch, num_actions)
  actions = int(batch.loss_mask.sum())
  print(f"{name}: {size.layers} layers, d = {size.hidden}, vocab {size.vocab:,}, batch "
        f"{size.batch} x {size.length} ({actions / tokens:.0%} action tokens, action "
        f"bucket {num_actions}), RL step with KL:")
  for label, t, mem in (("ours, behaviour forward off", t_lean, mem_ours),
                        ("ours, default (+ behaviour fwd)", t_default, mem_default),
                        ("torch eager", t_torch, None)):
    print(f"  {label:32s} {tokens / t:9.0f} tok/s  {t * 1e3:7.0f} ms" +
          ("" if mem is None else f"  peak {mem / 2**20:7.0f} MiB"))
  if lora_rank:
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    full, trained = count(states[False].params), count(states["lora"].params)
    mem_lora = xla_peak(steps["lora"], states["lora"], batch, num_actions)
    print(f"  {f'ours, LoRA rank {lora_rank}, fwd off':32s} {tokens / times[3]:9.0f} tok/s  "
          f"{times[3] * 1e3:7.0f} ms  peak {mem_lora / 2**20:7.0f} MiB  trains {trained:,} "
          f"of {full:,} parameters ({trained / full:.2%}); vs full: step time "
          f"{times[3] / t_lean:.2f}x, peak memory {mem_lora / mem_ours:.2f}x")
  return dict(speed=t_torch / t_lean, mem_ours=mem_ours, step=steps[False],
              state=states[False])


def count_recompiles(step, state, rng, iterations):
  """New compilations over `iterations` tiny steps on random lengths."""
  size = SIZES["tiny"]
  buckets = (size.length // 2, size.length)
  for b in buckets:
    state, _ = step(state, random_batch(rng, size, [b] * size.batch, buckets))
  warm = step.traces
  for _ in range(iterations):
    lengths = rng.integers(8, size.length + 1, size.batch)
    state, _ = step(state, random_batch(rng, size, lengths, buckets))
  return step.traces - warm


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sizes", default="tiny,qwenvocab")
  p.add_argument("--iterations", type=int, default=50)
  p.add_argument("--lora", type=int, default=0, help="also time a rank-R LoRA step")
  p.add_argument("--torch-peak-of", help=argparse.SUPPRESS)  # see torch_peak
  args = p.parse_args()
  if args.torch_peak_of:
    print(_torch_peak_here(args.torch_peak_of))
    return
  names = args.sizes.split(",")
  rng = np.random.default_rng(0)
  print(f"{jax.devices()[0].platform}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)")
  out = {name: compare(name, SIZES[name], rng, args.lora) for name in names}
  line = [f"step_vs_torch_{name}={out[name]['speed']:.2f}" for name in names]
  if "tiny" in out:
    recompiles = count_recompiles(out["tiny"]["step"], out["tiny"]["state"], rng,
                                  args.iterations)
    print(f"{args.iterations} tiny steps on random lengths after warm-up: "
          f"{recompiles} recompilations")
  print("peak memory of a step, state included (behaviour forward off):")
  for name in names:
    mem_torch = torch_peak(name)
    out[name]["mem_ratio"] = out[name]["mem_ours"] / mem_torch
    print(f"  {name:10s} ours {out[name]['mem_ours'] / 2**20:7.0f} MiB  torch eager "
          f"{mem_torch / 2**20:7.0f} MiB  ratio {out[name]['mem_ratio']:.2f}")
  if "qwenvocab" in out:
    line.append(f"peak_mem_vs_torch_qwenvocab={out['qwenvocab']['mem_ratio']:.2f}")
  if "tiny" in out:
    line.append(f"recompiles={recompiles}")
  print(" ".join(line))


if __name__ == "__main__":
  main()
