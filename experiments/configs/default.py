"""The embedded default: the tiny model learns text FrozenLake, SFT then RL.

  python experiments/train_agent.py --config=experiments/configs/default.py \\
      --workdir=runs/default

A 2-layer, d=128 model with the bundled tokenizer, trained from scratch on
2 CPU cores: a short SFT on the scripted expert (BFS shortest path), 75
steps, which leaves the policy reading the map badly (room for RL), then
GRPO with 8 rollouts per 4x4 map on the outcome reward, 8 maps (64
episodes) per iteration, two optimizer steps on each batch (PPO epochs) at
6e-4. The agent reads the grid each turn and answers with
<move>left|down|right|up</move>.

It prints held-out success on 128 unseen maps (greedy, and at temperature 1
with 4 episodes per map) after SFT and after RL. Other seeds:
`--config.seed=K`. What this command measured, per seed and per machine
type: README.md ("Two commands") and docs/results.md.
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
  # Decode over the whole cache, as when the README's figures were measured:
  # the faster windows (set ()) sum attention in another order, ~1e-6 apart,
  # which is enough for a long RL run to drift from those exact numbers.
  c.sampler.attention_windows = (512,)
  c.rl.buckets = (256, 384, 512)
  c.rl.tasks_per_iteration = 8
  # Larger steps than a fine-tune of a real model: the tiny policy starts
  # far from good (docs/results.md has what 5e-5 and 3e-4 gave).
  c.rl_optim.learning_rate = 6e-4
  c.rl_optim.total_steps = 150
  c.loss.ppo_epochs = 2
  c.env.num_eval_tasks = 128
  c.sft.steps = 75
  c.iterations = 60
  return c
