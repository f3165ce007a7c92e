"""Qwen2.5-0.5B-Instruct from a local directory, bf16, on an accelerator.

  HF_HUB_OFFLINE=1 python experiments/train_agent.py \
      --config=experiments/configs/qwen_tpu.py:/models/Qwen2.5-0.5B-Instruct \
      --workdir=runs/qwen_search_qa

The string after ':' is the local checkpoint directory (config.json,
*.safetensors and the tokenizer files, e.g. from `huggingface-cli download
Qwen/Qwen2.5-0.5B-Instruct --local-dir /models/Qwen2.5-0.5B-Instruct` on a
machine with network), optionally followed by `,smoke`: the whole run at
the smallest size (`_smoke`), for a CPU or a first check of a new machine;
benchmarks/smoke_run.py runs it on a random checkpoint of this shape and
prints its peak memory. The tokenizer is the checkpoint's own. The task is
SearchQA with `search` as a JSON tool ("search_qa_tools") in the `qwen2.5`
chat format: the tool's schema in the system turn and `<tool_call>` JSON, as
Qwen2.5-Instruct was trained to call tools. Compute is bf16 over float32
master weights (`model.param_dtype`). It runs on one device as is; over a TPU
slice or several GPUs add a mesh, e.g. `--config.mesh.fsdp=4` (README,
"Your own model and a TPU"; `agentrl_jax.sharding`). Not run on an
accelerator yet, so it states no expected result.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import search_qa  # pylint: disable=wrong-import-position


def get_config(arg="/models/Qwen2.5-0.5B-Instruct"):
  model_dir, _, variant = arg.partition(",")
  if variant not in ("", "smoke"):
    raise ValueError(f"unknown variant {variant!r} of qwen_tpu (known: smoke)")
  c = search_qa.get_config()
  c.model.path = model_dir
  c.model.tokenizer = model_dir
  c.model.dtype = "bfloat16"  # compute; the masters stay float32
  # Recompute each layer in the backward pass, casting its weights where it
  # runs: the RL step's temporaries grow 0.11 GiB a layer instead of 0.72 at
  # 4 x 1024 tokens in 4 micro-batches on XLA:CPU
  # (benchmarks/step_memory.py); a TPU is not measured.
  c.model.remat = True
  c.env.name = "search_qa_tools"
  c.env.kwargs = {}
  c.env.chat_format = "qwen2.5"
  c.rollout.system_prompt = None  # the environment's full instructions
  c.rollout.max_action_tokens = 256
  c.rollout.lockstep = False  # tool calls overlap decoding (base.py's CPU runs: True)
  c.sampler.num_slots = 128
  c.sampler.cache_length = 4096
  c.sampler.length_buckets = (64, 256, 1024)
  c.rl.buckets = (1024, 2048, 4096)
  c.rl.tasks_per_iteration = 16
  c.loss.micro_batches = 8
  c.loss.kl_beta = 0.01
  c.sft.steps = 0  # the instruct model already follows the format
  c.optim.learning_rate = 1e-6
  c.rl_optim.learning_rate = 1e-6
  c.iterations = 200
  if variant == "smoke":
    _smoke(c)
  return c


def _smoke(c):
  """The same model and step at the smallest useful size: one RL iteration
  of 2 tasks x 2 episodes of up to 2 turns, 4 held-out tasks, 1024-token
  rows. Fits a CPU (benchmarks/smoke_run.py measures its peak memory)."""
  c.iterations = 1
  c.rl.tasks_per_iteration, c.rl.group_size = 2, 2
  c.env.num_eval_tasks, c.eval_samples = 4, 0
  c.sampler.num_slots, c.sampler.cache_length = 4, 1024
  c.sampler.length_buckets, c.sampler.attention_windows = (256, 1024), (1024,)
  c.rl.buckets = (1024,)
  c.rollout.max_turns, c.rollout.max_action_tokens = 2, 24
  c.loss.micro_batches = 4  # one row each: the accumulation path is exercised
  c.log.trajectories_every, c.log.eval_episodes = 0, 0
  # The last checkpoint's write ran beside the evaluation at up to 2.8 GiB
  # above the state (its encoded chunks); 1 GB in flight bounds that.
  c.checkpoint_write_gb = 1.0
