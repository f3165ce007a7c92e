"""Our library side by side with Tunix (google-tunix 0.1.7), in one process.

Setup, once: Tunix needs safetensors < 0.8 (our pins say 0.8.0), so it gets
a virtual environment of its own, outside the repository:

  python3.11 -m venv /work/tunix-venv
  /work/tunix-venv/bin/pip install -r benchmarks/requirements-tunix.txt

Run, from the repository root (both libraries import in this one process):

  HF_HUB_OFFLINE=1 PYTHONPATH=. /work/tunix-venv/bin/python benchmarks/vs_tunix.py

The same random Qwen2 weights, made by transformers (torch) and saved once
as HF safetensors, are loaded by each library's own loader:
`models.from_pretrained` and `tunix.models.qwen2.params.
create_model_from_safe_tensors`. float32 throughout. One tokenizer serves
both: a 4096-token byte-level BPE trained on the bundled corpus
(`tokenizer.train_bpe_tokenizer`), as an HF tokenizer (Tunix's sampler takes
one and prompt strings; ours takes token ids, so our side encodes the same
strings and decodes its actions to text inside the timed calls too).

1. Decode at temperature 1 with per-token log-probs, after a 16-token
   prompt: our `Sampler.prefill` + `decode` against Tunix's
   `generate.sampler.Sampler` called as its `VanillaRollout` calls it
   (`top_p=1.0`, `return_logprobs=True`, a fixed `max_prompt_length`). An
   EOS id outside the vocabulary keeps Tunix from stopping early; both
   decode every token (checked).
2. A multi-turn episode (T turns of A-token actions, O-token observations
   in between): ours extends each slot's KV cache by the observation;
   Tunix as its agentic collector does (`trajectory_collect_engine.py`
   hands the whole conversation to `model_call` every turn, and its
   `VanillaRollout` pads every prompt to the rollout config's
   `max_prompt_length`): the conversation text goes back into the sampler
   each turn, re-prefilled into a fresh cache. Its `max_prompt_length` is
   the longest conversation it meets, rounded up to 64 (a dry run with the
   same seeds finds it), the setting most favourable to it. String
   concatenation stands in for its chat template.
3. The GRPO train step on one batch (B x L tokens in T turns, a mask of
   action tokens, one advantage per row): our `train.RLStep` (token-mean
   clipped surrogate, k3 KL with beta 0.04 to a frozen reference, entropy
   metric on, AdamW + global-norm clipping) against Tunix's own path: the
   reference log-probs through `rl.common.compute_per_token_logps` (what
   its inference worker runs) and then its actor `rl.trainer.Trainer`'s
   jitted train step with the GRPO policy loss
   (`function_registry.get_policy_loss_fn("grpo")`) wired as
   `GRPOLearner.__init__` wires it (`loss_agg_mode="token-mean"`,
   `kl_loss_mode="low_var_kl"`, beta 0.04, epsilon 0.2), the same optax
   transformation. Tunix's prompt is the first turn's observation, its
   completion the rest, `completion_mask` the action tokens. Peak memory:
   XLA's memory analysis of each library's compiled programs (arguments +
   outputs - donated aliases + temporaries, the larger of the reference's
   and the step's).

Timings are medians over interleaved rounds (ours, Tunix, ours, ...) after
a compiling warm-up; ratios are ours over Tunix in speed (higher is
better). Last line: `decode_vs_tunix=<d = 512, batch 64>
episode_vs_tunix=<d = 512> step_vs_tunix=<d = 512>`.
"""

import argparse
import dataclasses
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
  from tunix.generate import sampler as tunix_sampler
  from tunix.models.qwen2 import model as tunix_qwen2
  from tunix.models.qwen2 import params as tunix_params
  from tunix.rl import common as tunix_common
  from tunix.rl import function_registry as tunix_registry
  from tunix.rl import trainer as tunix_trainer
  from tunix.rl.grpo import grpo_learner as tunix_grpo
  from tunix.sft import peft_trainer as tunix_peft
except ImportError as e:
  sys.exit(f"benchmarks/vs_tunix.py needs Tunix ({e}); set up its own environment "
           "with `pip install -r benchmarks/requirements-tunix.txt` (see this "
           "script's docstring)")

import common
from common import median_times
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from train_step import xla_peak

from agentrl_jax import losses, models, train
from agentrl_jax import tokenizer as tok_lib
from agentrl_jax.sampling import Sampler
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate

VOCAB = 4096
PROMPT = 16
BETA, EPS = 0.04, 0.2


def interleaved(fns, rounds):
  """`median_times` after one more warm-up call each: Tunix's train step
  compiles again on its second call (its state after an update), and the
  first calls of a sampler are slow after their compile."""
  for fn in fns:
    fn()
  return median_times(fns, rounds)


@dataclasses.dataclass(frozen=True)
class Size:
  layers: int
  hidden: int
  heads: int
  kv_heads: int

  @property
  def head_dim(self) -> int:
    return self.hidden // self.heads

  def label(self) -> str:
    return f"{self.layers} layers, d = {self.hidden}"


SIZES = {"small": Size(2, 128, 4, 2), "goal": Size(4, 512, 8, 2)}


@dataclasses.dataclass
class Pair:
  """One checkpoint, loaded by both libraries."""

  size: Size
  path: str
  tokenizer: transformers.PreTrainedTokenizerFast

  def ours(self) -> models.Decoder:
    return models.from_pretrained(self.path)

  def tunix(self):
    s = self.size
    cfg = tunix_qwen2.ModelConfig(
        num_layers=s.layers, vocab_size=VOCAB, embed_dim=s.hidden, hidden_dim=2 * s.hidden,
        num_heads=s.heads, head_dim=s.head_dim, num_kv_heads=s.kv_heads,
        rope_theta=10_000, norm_eps=1e-6)
    return tunix_params.create_model_from_safe_tensors(self.path, cfg)

  def cache_config(self, cache_size: int):
    s = self.size
    return tunix_sampler.CacheConfig(cache_size=cache_size, num_layers=s.layers,
                                     num_kv_heads=s.kv_heads, head_dim=s.head_dim)


def make_pair(size: Size, tok, root: str) -> Pair:
  """Random Qwen2 weights saved by transformers, with the tokenizer beside them."""
  hf = transformers.Qwen2Config(
      vocab_size=VOCAB, hidden_size=size.hidden, intermediate_size=2 * size.hidden,
      num_hidden_layers=size.layers, num_attention_heads=size.heads,
      num_key_value_heads=size.kv_heads, max_position_embeddings=4096,
      rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False)
  torch.manual_seed(0)
  path = os.path.join(root, f"qwen2_{size.layers}x{size.hidden}")
  transformers.Qwen2ForCausalLM(hf).save_pretrained(path)
  tok.save_pretrained(path)
  return Pair(size, path, tok)


def corpus_texts(tok, length: int, count: int, start: int = 0) -> list[str]:
  """`count` corpus snippets that encode to exactly `length` tokens."""
  ids = tok.encode(tok_lib.BUNDLED_CORPUS.read_text(), add_special_tokens=False)
  out, i = [], start
  while len(out) < count:
    text = tok.decode(ids[i:i + length])
    if tok.encode(text, add_special_tokens=False) == ids[i:i + length]:
      out.append(text)
    i += length
  return out


def tunix_call(sampler, prompts, new_tokens, max_prompt_length, seed):
  """Tunix's sampler as its VanillaRollout calls it, sampling at T = 1."""
  return sampler(prompts, max_generation_steps=new_tokens,
                 max_prompt_length=max_prompt_length, echo=False, temperature=1.0,
                 top_p=1.0, top_k=None, seed=seed, pad_output=False,
                 eos_tokens=[VOCAB],  # never sampled: every row decodes every token
                 return_logprobs=True)


# -- 1. Decode -----------------------------------------------------------------------


def decode(pair: Pair, batch: int, new_tokens: int, rounds: int) -> dict:
  tok = pair.tokenizer
  prompts = corpus_texts(tok, PROMPT, batch)
  ours = Sampler(pair.ours(), num_slots=batch, cache_length=PROMPT + new_tokens,
                 max_decode_length=new_tokens, length_buckets=(PROMPT,))
  theirs = tunix_sampler.Sampler(pair.tunix(), tok, pair.cache_config(PROMPT + new_tokens))
  slots = list(range(batch))

  def run_ours():
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    state = ours.prefill(ours.init_state(0), slots, ids)
    _, actions = ours.decode(state, slots, max_new_tokens=new_tokens)
    texts = [tok.decode(a.tokens) for a in actions.values()]
    assert all(len(a.raw_logprobs) == new_tokens for a in actions.values()), texts[:0]

  def run_tunix():
    out = tunix_call(theirs, prompts, new_tokens, PROMPT, 0)
    assert all(len(lp) == new_tokens for lp in out.logprobs)

  floor = dense_floor(pair.size, batch, new_tokens)
  t_ours, t_tunix, t_floor = interleaved([run_ours, run_tunix, floor], rounds)
  n = batch * new_tokens
  return dict(ours=n / t_ours, tunix=n / t_tunix, ratio=t_tunix / t_ours,
              ms=[1e3 * t / new_tokens for t in (t_ours, t_tunix, t_floor)])


def dense_floor(size: Size, batch: int, new_tokens: int):
  """`common.dense_floor` at `size`: both libraries hand these dots to XLA:CPU."""
  return common.dense_floor(layers=size.layers, hidden=size.hidden,
                            intermediate=2 * size.hidden,
                            q_width=size.heads * size.head_dim,
                            kv_width=size.kv_heads * size.head_dim, vocab=VOCAB,
                            batch=batch, new_tokens=new_tokens)


# -- 2. Episode ----------------------------------------------------------------------


def episode(pair: Pair, batch: int, turns: int, action: int, observation: int,
            rounds: int) -> dict:
  tok = pair.tokenizer
  prompts = corpus_texts(tok, PROMPT, batch)
  obs = np.asarray(corpus_texts(tok, observation, batch * (turns - 1), start=5000),
                   dtype=object).reshape(turns - 1, batch)
  slots = list(range(batch))
  # Ours: prefill, then per turn decode A tokens and extend by O (no
  # observation after the last action: Tunix never feeds one either).
  cache = PROMPT + turns * action + (turns - 1) * observation
  ours = Sampler(pair.ours(), num_slots=batch, cache_length=cache,
                 max_decode_length=action, length_buckets=(PROMPT, observation))

  def run_ours():
    state = ours.prefill(ours.init_state(0), slots,
                         [tok.encode(p, add_special_tokens=False) for p in prompts])
    for t in range(turns):
      state, actions = ours.decode(state, slots, max_new_tokens=action)
      _ = [tok.decode(actions[s].tokens) for s in slots]  # what an environment reads
      if t < turns - 1:
        state = ours.extend(state, slots, [tok.encode(o, add_special_tokens=False)
                                           for o in obs[t]])
    jax.block_until_ready(state.next_logits)

  tunix_model = pair.tunix()
  fed = []

  def run_tunix(sampler, max_prompt_length):
    conversation = list(prompts)
    fed.clear()
    for t in range(turns):
      fed.append(max(len(sampler.tokenize(c)) for c in conversation))
      out = tunix_call(sampler, conversation, action, max_prompt_length, t)
      assert all(len(lp) == action for lp in out.logprobs)
      if t < turns - 1:
        conversation = [c + a + o for c, a, o in zip(conversation, out.text, obs[t])]

  # A dry run finds the longest conversation (the text re-encodes the
  # sampled actions into more tokens than were sampled); the same seeds give
  # the same samples whatever the padding.
  longest = cache + turns * action
  run_tunix(tunix_sampler.Sampler(tunix_model, tok, pair.cache_config(longest + action)),
            longest)
  max_prompt = -(-max(fed) // 64) * 64
  theirs = tunix_sampler.Sampler(tunix_model, tok, pair.cache_config(max_prompt + action))
  # One warm-up each (the dry run already paid Tunix's slow first calls).
  t_ours, t_tunix = median_times([run_ours, lambda: run_tunix(theirs, max_prompt)], rounds)
  return dict(ours=t_ours, tunix=t_tunix, ratio=t_tunix / t_ours, max_prompt=max_prompt,
              tunix_context=max(fed), ours_context=cache - action)


# -- 3. GRPO train step --------------------------------------------------------------


def step_batch(rng, batch: int, length: int, turns: int, pad_id: int):
  """Rows of `turns` (observation, action) chunks, half of each the action;
  one advantage per row on its action tokens. No pad id inside (Tunix masks
  it out of attention)."""
  chunk, trajs = length // turns, []
  for _ in range(batch):
    segs = []
    for t in range(turns):
      o, a = (rng.integers(0, VOCAB - 1, n) for n in (chunk // 2, chunk - chunk // 2))
      o[o >= pad_id] += 1
      a[a >= pad_id] += 1
      segs += [Segment(Role.SYSTEM if t == 0 else Role.OBSERVATION, o),
               Segment(Role.ASSISTANT, a, -rng.uniform(3, 7, a.size))]
    trajs.append(Trajectory(segs, reward=0.0))
  b = collate(trajs, buckets=(length,), num_rows=batch)
  adv = rng.normal(size=batch).astype(np.float32)
  return b.replace(advantages=b.loss_mask * adv[:, None]), adv, chunk // 2


def grpo_step(pair: Pair, batch: int, length: int, turns: int, rounds: int) -> dict:
  tok = pair.tokenizer
  pad, eos = tok.pad_token_id, tok.eos_token_id
  b, adv, prompt_len = step_batch(np.random.default_rng(0), batch, length, turns, pad)
  tx = train.make_optimizer(train.OptimConfig(learning_rate=1e-5, warmup_steps=1))

  # Ours.
  graphdef, state = train.init_train_state(pair.ours(), tx, with_reference=True)
  step = train.RLStep(graphdef, tx, train.LossConfig(
      clip_low=EPS, clip_high=EPS, kl_beta=BETA, kl_kind="k3", agg="token-mean"))
  num_actions = losses.action_bucket(losses.most_actions(b.loss_mask), length)
  box = [state]

  def run_ours():
    box[0], metrics = step(box[0], b, num_actions)
    jax.block_until_ready(metrics)

  # Tunix: the reference forward as its inference worker runs it, then the
  # actor trainer's jitted step with the GRPO loss, wired as GRPOLearner does.
  policy, ref = pair.tunix(), pair.tunix()
  ref_graphdef, ref_state = nnx.split(ref)
  cfg = tunix_grpo.GRPOConfig(num_generations=2, beta=BETA, epsilon=EPS,
                              loss_agg_mode="token-mean", kl_loss_mode="low_var_kl")
  cfg.temperature = 1.0  # GRPOLearner copies the rollout's
  trainer = tunix_trainer.Trainer(
      policy, tx, tunix_peft.TrainingConfig(eval_every_n_steps=10**9),
      custom_checkpoint_metadata_fn=dict)
  loss_fn = tunix_registry.get_policy_loss_fn(cfg.policy_loss_fn)
  trainer.with_loss_fn(lambda model, train_example, algo_config: loss_fn(
      model, train_example, algo_config=algo_config, pad_id=pad, eos_id=eos), has_aux=True)
  trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": cfg})
  train_step, _ = trainer.jit_train_and_eval_step()
  tokens = jnp.asarray(b.tokens)
  prompt_ids, completion_ids = tokens[:, :prompt_len], tokens[:, prompt_len:]
  ref_kw = dict(prompt_tokens=prompt_ids, completion_tokens=completion_ids, pad_id=pad,
                eos_id=eos, stop_gradient=True, return_logits=False)

  def example(ref_logps):
    return tunix_grpo.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != pad, completion_ids=completion_ids,
        completion_mask=jnp.asarray(b.loss_mask[:, prompt_len:]),
        advantages=jnp.asarray(adv), ref_per_token_logps=ref_logps,
        old_per_token_logps=None)

  def run_tunix():
    ref_logps = tunix_common.compute_per_token_logps(ref_graphdef, ref_state, **ref_kw)
    loss, _, _ = train_step(example(ref_logps))
    jax.block_until_ready(loss)

  def peak(m):
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)

  t_ours, t_tunix = interleaved([run_ours, run_tunix], rounds)
  # Lowered after the timed steps: the programs that ran (see `interleaved`).
  ref_logps = tunix_common.compute_per_token_logps(ref_graphdef, ref_state, **ref_kw)
  mem_tunix = max(
      peak(tunix_common.compute_per_token_logps.lower(ref_graphdef, ref_state, **ref_kw)
           .compile().memory_analysis()),
      peak(train_step.func.lower(*train_step.args, example(ref_logps))
           .compile().memory_analysis()))
  mem_ours = xla_peak(step, box[0], b, num_actions)
  n = batch * length
  return dict(ours=n / t_ours, tunix=n / t_tunix, ratio=t_tunix / t_ours,
              mem_ours=mem_ours, mem_tunix=mem_tunix,
              actions=float(b.loss_mask.sum()) / n)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sizes", default="small,goal")
  p.add_argument("--batches", default="16,64")
  p.add_argument("--new_tokens", type=int, default=128)
  p.add_argument("--episodes", type=int, default=16)
  p.add_argument("--turns", type=int, default=8)
  p.add_argument("--action", type=int, default=64)
  p.add_argument("--observation", type=int, default=128)
  p.add_argument("--step_batch", type=int, default=16)
  p.add_argument("--step_length", type=int, default=256)
  p.add_argument("--step_turns", type=int, default=4)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--episode_rounds", type=int, default=3)
  p.add_argument("--sections", default="decode,episode,step")
  args = p.parse_args()
  sections = args.sections.split(",")
  corpus = tok_lib.BUNDLED_CORPUS.read_text().splitlines()
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok_lib.train_bpe_tokenizer(corpus, VOCAB),
      eos_token="<|im_end|>", pad_token="<|endoftext|>")
  print(f"{jax.devices()[0].platform}, jax {jax.__version__}, Qwen2 float32, vocab "
        f"{VOCAB}, {args.rounds} interleaved rounds")
  rows, line, where = [], {}, []
  with tempfile.TemporaryDirectory() as root:
    for name in args.sizes.split(","):
      pair = make_pair(SIZES[name], tok, root)
      label = pair.size.label()
      if "decode" in sections:
        for batch in map(int, args.batches.split(",")):
          r = decode(pair, batch, args.new_tokens, args.rounds)
          rows.append((f"decode {args.new_tokens} tokens x {batch}, T = 1, log-probs",
                       label, f"{r['ours']:,.0f} tok/s", f"{r['tunix']:,.0f} tok/s",
                       r["ratio"]))
          print(rows[-1], flush=True)
          line[("decode", name, batch)] = r["ratio"]
          where.append((batch, label, *r["ms"]))
      if "episode" in sections:
        r = episode(pair, args.episodes, args.turns, args.action, args.observation,
                    args.episode_rounds)
        rows.append((f"{args.episodes} episodes x {args.turns} turns ({args.action}-token "
                     f"actions, {args.observation}-token observations): ours extends, "
                     f"Tunix re-prefills (max_prompt_length {r['max_prompt']}; longest "
                     f"context {r['tunix_context']} vs ours {r['ours_context']} tokens)",
                     label, f"{r['ours']:.2f} s", f"{r['tunix']:.2f} s", r["ratio"]))
        print(rows[-1], flush=True)
        line[("episode", name)] = r["ratio"]
      if "step" in sections:
        r = grpo_step(pair, args.step_batch, args.step_length, args.step_turns,
                      args.rounds)
        rows.append((f"GRPO step, {args.step_batch} x {args.step_length} tokens "
                     f"({r['actions']:.0%} action tokens in {args.step_turns} turns), KL "
                     f"beta {BETA}: peak memory ours {r['mem_ours'] / 2**20:,.0f} MiB, "
                     f"Tunix {r['mem_tunix'] / 2**20:,.0f} MiB",
                     label, f"{r['ours']:,.0f} tok/s", f"{r['tunix']:,.0f} tok/s",
                     r["ratio"]))
        print(rows[-1], flush=True)
        line[("step", name)] = r["ratio"]
  print("\n| measurement | model | ours | Tunix | ours / Tunix |\n|---|---|---|---|---|")
  for what, label, ours, theirs, ratio in rows:
    print(f"| {what} | {label} | {ours} | {theirs} | {ratio:.2f}x |")
  if where:
    print("\nDecode, ms per step (all rows): the dense matmuls alone (`dense_floor`) "
          "and what each sampler adds to them\n\n| batch | model | ours | Tunix | dense "
          "matmuls | ours above it | Tunix above it |\n|---|---|---|---|---|---|---|")
    for batch, label, ours, theirs, floor in where:
      print(f"| {batch} | {label} | {ours:.2f} | {theirs:.2f} | {floor:.2f} | "
            f"{ours - floor:.2f} | {theirs - floor:.2f} |")
  last = {"decode_vs_tunix": line.get(("decode", "goal", 64)),
          "episode_vs_tunix": line.get(("episode", "goal")),
          "step_vs_tunix": line.get(("step", "goal"))}
  print(" ".join(f"{k}={'n/a' if v is None else f'{v:.2f}'}" for k, v in last.items()))


if __name__ == "__main__":
  main()
