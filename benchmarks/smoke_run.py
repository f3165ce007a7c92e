"""The accelerator config's smoke run on a real-size model: peak memory, tokens/s.

  python benchmarks/smoke_run.py [--dir /tmp/qwen2.5-0.5b-random] [--flag=...]

Builds (once, into --dir) a random-weight checkpoint with Qwen2.5-0.5B's
architecture, saved by transformers in bf16, with the real Qwen2.5
tokenizer beside it; then runs `experiments/train_agent.py
--config=experiments/configs/qwen_tpu.py:DIR,smoke` (extra arguments are
passed on as flags) in a child process and reports:
- the child's peak resident memory (the kernel's high-water mark VmHWM,
  read every 0.2 s; XLA's compile-time buffers count), next to what the state
  needs (`state_memory.py`'s count at fsdp = 1: float32 masters, AdamW
  moments, gradients, the bf16 KL reference and sampler copy);
- rollout tokens/s (action tokens sampled over the sampler's time, its
  prefills of prompts and observations included)
  and train tokens/s (the batch's action tokens over the step's time, the
  first call's compile included: one iteration is all a smoke run has).

Random weights never solve a task: held-out success 0 is expected. The last
line is `peak_rss_gib=... state_gib=... over_state_gib=... rollout_tokens_per_s=...
train_step_s=... train_tokens_per_s=...`.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30


def build_checkpoint(out: pathlib.Path) -> None:
  """A Qwen2.5-0.5B-shaped checkpoint with random weights, and the tokenizer."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  from agentrl_jax import tokenizer  # pylint: disable=g-import-not-at-top
  hf = transformers.Qwen2Config(
      vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
      bos_token_id=151643, eos_token_id=151645)
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(hf).to(torch.bfloat16).save_pretrained(out)
  tokenizer.qwen2_tokenizer().save_pretrained(out)


def high_water_kib(pid: int) -> int:
  """The process's peak resident KiB so far (VmHWM; 0 once it is gone).
  Not the children's ru_maxrss: exec keeps the parent's high-water mark in
  it, and this parent held a torch model."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return int(next(l.split()[1] for l in f if l.startswith("VmHWM:")))
  except (FileNotFoundError, ProcessLookupError, StopIteration):
    return 0


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(),
                                               "qwen2.5-0.5b-random"))
  args, flags = p.parse_known_args()
  ckpt = pathlib.Path(args.dir)
  if not (ckpt / "config.json").exists():
    t0 = time.perf_counter()
    build_checkpoint(ckpt)
    print(f"built {ckpt} in {time.perf_counter() - t0:.0f} s")
  with tempfile.TemporaryDirectory() as workdir:
    t0 = time.perf_counter()
    run = subprocess.Popen(
        [sys.executable, "experiments/train_agent.py", f"--workdir={workdir}",
         f"--config=experiments/configs/qwen_tpu.py:{ckpt},smoke", *flags],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    peak = 0
    while run.poll() is None:
      peak = max(peak, high_water_kib(run.pid))
      time.sleep(0.2)
    wall = time.perf_counter() - t0
    if run.returncode:
      raise SystemExit(f"the smoke run failed (exit {run.returncode})")
    rows = [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl")
            .read_text().splitlines()]
  peak = peak * 1024 / GIB
  it = next(r for r in rows if "train/batch_tokens" in r)
  generated = it["rollout/action_tokens_mean"] * it["rollout/episodes"]
  rollout_tps = generated / max(it["rollout/generation_s"], 1e-9)
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import state_memory  # pylint: disable=g-import-not-at-top
  state = state_memory.state_memory(state_memory.QWEN25["qwen2.5-0.5b"], 1)["total"] / GIB
  print(f"smoke run: {wall:.0f} s wall; peak RSS {peak:.2f} GiB, the state "
        f"{state:.2f} GiB; rollout {rollout_tps:.0f} tokens/s; train step "
        f"{it['time/step_s']:.0f} s for {it['train/batch_tokens']:.0f} action tokens")
  print(f"peak_rss_gib={peak:.2f} state_gib={state:.2f} over_state_gib={peak - state:.2f} "
        f"rollout_tokens_per_s={rollout_tps:.1f} train_step_s={it['time/step_s']:.1f} "
        f"train_tokens_per_s={it['train/batch_tokens'] / it['time/step_s']:.2f}")


if __name__ == "__main__":
  main()
