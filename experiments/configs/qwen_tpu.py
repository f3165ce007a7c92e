"""Qwen2.5-0.5B-Instruct from a local directory, bf16, on an accelerator.

  HF_HUB_OFFLINE=1 python experiments/train_agent.py \
      --config=experiments/configs/qwen_tpu.py:/models/Qwen2.5-0.5B-Instruct \
      --workdir=runs/qwen_search_qa

The string after ':' is the local checkpoint directory (config.json,
*.safetensors and the tokenizer files, e.g. from `huggingface-cli download
Qwen/Qwen2.5-0.5B-Instruct --local-dir /models/Qwen2.5-0.5B-Instruct` on a
machine with network). The tokenizer is the checkpoint's own. The task is
SearchQA with `search` as a JSON tool ("search_qa_tools") in the `qwen2.5`
chat format: the tool's schema in the system turn and `<tool_call>` JSON, as
Qwen2.5-Instruct was trained to call tools. It runs on one device as is;
over a TPU slice or several GPUs add a mesh, e.g. `--config.mesh.fsdp=4`
(README, "Your own model and a TPU"; `agentrl_jax.sharding`). Not run yet: no checkpoint or accelerator was
available where this config was written, so it states no expected result.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import search_qa  # pylint: disable=wrong-import-position


def get_config(model_dir="/models/Qwen2.5-0.5B-Instruct"):
  c = search_qa.get_config()
  c.model.path = model_dir
  c.model.tokenizer = model_dir
  c.model.dtype = "bfloat16"
  c.env.name = "search_qa_tools"
  c.env.kwargs = {}
  c.env.chat_format = "qwen2.5"
  c.rollout.system_prompt = None  # the environment's full instructions
  c.rollout.max_action_tokens = 256
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
  return c
