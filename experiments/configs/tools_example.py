"""Your own task: Python functions as JSON tools, SFT on a scripted expert, then RL.

  python experiments/train_agent.py --config=experiments/configs/tools_example.py \\
      --workdir=runs/tools_example

The environment is warehouse_tools.py's `make_env` (two tools, a reward, a
JSONL tasks file), loaded by its path; the chat format is Qwen2.5's, so the
tools' JSON schemas sit in the system turn and the model calls them in
`<tool_call>` blocks as Qwen2.5-Instruct does. The tiny model learns it from
scratch on a CPU; README ("Your own task") has the figures it reaches.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # pylint: disable=wrong-import-position


def get_config():
  c = base.get_config()
  here = os.path.dirname(os.path.abspath(__file__))
  c.env.name = os.path.join(here, "warehouse_tools.py") + ":make_env"
  c.env.chat_format = "qwen2.5"
  c.model.tokenizer = os.path.join(here, "warehouse_tokenizer.json")
  c.model.tiny = {"vocab_size": 1024}
  c.env.num_train_tasks = 480
  c.env.num_eval_tasks = 128
  c.rollout.max_turns = 3
  c.rollout.max_action_tokens = 48
  c.sampler.cache_length = 192
  c.sampler.length_buckets = (16, 64)
  c.rl.buckets = (96, 192)
  c.sft.steps = 400
  c.optim.total_steps = 400
  c.iterations = 40
  return c
