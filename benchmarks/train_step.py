"""Train-step throughput vs PyTorch eager, and recompilations over a run.

  python benchmarks/train_step.py [--batch 16 --length 256 --iterations 50]

Ours: `train.RLStep` (token-mean clipped surrogate, k3 KL to a frozen
reference with beta 0.02, AdamW, global-norm clipping), jitted, state
donated. Baseline: the reference text's `agentic_grpo_step` loss (shifted
masked clipped surrogate + k3 KL, reference forward under no_grad) on
transformers' PyTorch `LlamaForCausalLM` with the same config, batch,
optimizer and clipping, eager. Both: median seconds per step after warm-up.

Then `iterations` RL steps on freshly collated batches of random lengths
(two length buckets, compiled in warm-up) count how many new compilations
happen (goal: none). The last line is `step_vs_torch=X recompiles=N`.
"""

import argparse
import copy

from common import llama_pair, median_time
import jax
import numpy as np
import torch

from agentrl_jax import train
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate

BETA, EPS = 0.02, 0.2


def random_batch(rng, batch, lengths, vocab, bucket):
  trajs = []
  for n in lengths:
    prompt = n // 4
    segs = [Segment(Role.SYSTEM, rng.integers(0, vocab, prompt)),
            Segment(Role.ASSISTANT, rng.integers(0, vocab, n - prompt),
                    -rng.uniform(3, 7, n - prompt))]
    trajs.append(Trajectory(segs, reward=float(rng.uniform())))
  b = collate(trajs, buckets=bucket, num_rows=batch)
  return b.replace(advantages=b.loss_mask * rng.normal(size=b.loss_mask.shape).astype(np.float32))


def torch_step(policy, ref, opt, tokens, mask, adv, old):
  """The reference text's agentic_grpo_step loss, on one prepared batch."""
  logits = policy(input_ids=tokens).logits
  logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
  m, a, o = mask[:, 1:], adv[:, 1:], old[:, 1:]
  ratio = torch.exp(logp - o)
  pg = -torch.min(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
  pg = (pg * m).sum() / m.sum().clamp(min=1.0)
  with torch.no_grad():
    ref_logits = ref(input_ids=tokens).logits
  rlp = torch.log_softmax(ref_logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
  diff = rlp - logp
  kl = ((torch.exp(diff) - diff - 1.0) * m).sum() / m.sum().clamp(min=1.0)
  loss = pg + BETA * kl
  opt.zero_grad()
  loss.backward()
  torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
  opt.step()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--length", type=int, default=256)
  p.add_argument("--iterations", type=int, default=50)
  args = p.parse_args()
  tpolicy, model = llama_pair()
  tref = copy.deepcopy(tpolicy).eval()
  rng = np.random.default_rng(0)
  bucket = (args.length,)
  batch = random_batch(rng, args.batch, [args.length] * args.batch, 512, bucket)
  tokens = batch.tokens.shape[0] * batch.tokens.shape[1]

  tx = train.make_optimizer(train.OptimConfig(learning_rate=1e-5, warmup_steps=1))
  graphdef, state = train.init_train_state(model, tx, with_reference=True)
  step = train.RLStep(graphdef, tx, train.LossConfig(clip_low=EPS, clip_high=EPS,
                                                     kl_beta=BETA))

  def ours():
    nonlocal state
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)

  opt = torch.optim.AdamW(tpolicy.parameters(), lr=1e-5, weight_decay=0.0)
  tb = [torch.tensor(np.asarray(x)) for x in
        (batch.tokens.astype(np.int64), batch.loss_mask, batch.advantages, batch.old_logprobs)]

  t_ours = median_time(ours)
  t_torch = median_time(lambda: torch_step(tpolicy, tref, opt, *tb))
  print(f"{jax.devices()[0].platform}, torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads); tiny Llama, batch {args.batch} x {args.length}, RL step with KL:")
  print(f"  ours (jit, donated)   {tokens / t_ours:9.0f} tok/s  ({t_ours * 1e3:.0f} ms)")
  print(f"  torch eager           {tokens / t_torch:9.0f} tok/s  ({t_torch * 1e3:.0f} ms)")

  # Recompilations over a run: random lengths, two buckets, all warmed up.
  buckets = (args.length // 2, args.length)
  for b in buckets:
    state, _ = step(state, random_batch(rng, args.batch, [b] * args.batch, 512, buckets))
  warm = step.traces
  for _ in range(args.iterations):
    lengths = rng.integers(8, args.length + 1, args.batch)
    state, _ = step(state, random_batch(rng, args.batch, lengths, 512, buckets))
  recompiles = step.traces - warm
  print(f"  {args.iterations} steps on random lengths after warm-up: {recompiles} recompilations")
  print(f"step_vs_torch={t_torch / t_ours:.2f} recompiles={recompiles}")


if __name__ == "__main__":
  main()
