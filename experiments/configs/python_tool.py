"""Python tool: write `solve`, try it with <python>, submit with <submit>.

  python experiments/train_agent.py --config=experiments/configs/python_tool.py \
      --workdir=runs/python_tool

Every <python>/<submit> runs in the sandbox (namespaces + cgroups on Linux
as root; rlimits only elsewhere, with a warning). Not yet tuned or measured
at the tiny size.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # pylint: disable=wrong-import-position


def get_config():
  c = base.get_config()
  c.env.name = "python_tool"
  c.rollout.max_turns = 3
  c.rollout.max_action_tokens = 128
  c.rollout.max_observation_tokens = 128
  c.sampler.cache_length = 1024
  c.rl.buckets = (256, 512, 1024)
  c.sft.steps = 400
  return c
