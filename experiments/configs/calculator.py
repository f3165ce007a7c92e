"""The tiny model learns the calculator tool, SFT then RL.

  python experiments/train_agent.py --config=experiments/configs/calculator.py \\
      --workdir=runs/calculator

A 2-layer, d=128 model with the bundled tokenizer, trained from scratch on
2 CPU cores: SFT on the scripted expert (short on purpose, so the policy is
imperfect), then GRPO with 8 rollouts per problem. Problems need one or two
<calc> calls before the <answer>.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # pylint: disable=wrong-import-position


def get_config():
  c = base.get_config()
  c.env.name = "calculator"
  c.env.task_kwargs = {"levels": (0, 1)}
  c.rollout.system_prompt = ("Solve it: use <calc>expression</calc> for "
                             "arithmetic, then <answer>number</answer>.")
  c.rollout.max_action_tokens = 24
  c.sampler.cache_length = 384
  c.sampler.length_buckets = (32, 64, 128)
  c.rl.buckets = (128, 256, 384)
  c.iterations = 30
  return c
