"""The embedded default: the tiny model learns text FrozenLake, SFT then RL.

  python experiments/train_agent.py --config=experiments/configs/default.py \\
      --workdir=runs/default

A 2-layer, d=128 model with the bundled tokenizer, trained from scratch on
2 CPU cores: a short SFT on the scripted expert (BFS shortest path), which
leaves the policy imperfect, then GRPO with 8 rollouts per 4x4 map on the
outcome reward. The agent reads the grid each turn and answers with
<move>left|down|right|up</move>.

Measured on 2 CPU cores (2026-11-29, seeds 0/1/2, about 4.5 min each):
held-out greedy success 0.656/0.680/0.398 after SFT, 0.633/0.625/0.688
after RL. Not yet a reliable RL gain; see the README.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # pylint: disable=wrong-import-position


def get_config():
  c = base.get_config()
  c.env.name = "frozen_lake"
  c.env.chat_format = "react"
  c.env.task_kwargs = {"sizes": (4,)}
  c.rollout.system_prompt = "Reach G, avoid H. Move with <move>left|down|right|up</move>."
  c.rollout.max_turns = 8
  c.sampler.cache_length = 512
  c.sampler.length_buckets = (32, 64, 128)
  c.rl.buckets = (256, 384, 512)
  c.rl.tasks_per_iteration = 4
  c.env.num_eval_tasks = 128
  c.sft.steps = 150
  c.iterations = 80
  return c
