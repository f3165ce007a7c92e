"""A longer horizon: 6x6 FrozenLake, outcome reward, SFT then RL.

  python experiments/train_agent.py --config=experiments/configs/frozen_lake_6x6.py:gigpo \\
      --workdir=runs/fl6_gigpo

Every 6x6 map (80% frozen cells) takes 10-12 moves, up to 12 turns; a
hole ends the episode at 0 and the reward is the outcome alone, so one
wrong turn into a dead end dooms an episode many turns before it ends.
Each observation also names what every move steps onto ("Next to you:
left F, down H, ..."): without that line the tiny model does not learn to
read a 6x6 grid from 256 demonstrations. GiGPO's anchors are the cells
(`FrozenLakeEnv.state_key`). The string after ':' picks the credit scheme
(any registered name: grpo, turn_returns, gae, gigpo, ...). What it
measured, and how long a run takes: docs/results.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import default  # pylint: disable=wrong-import-position


def get_config(scheme="grpo"):
  c = default.frozen_lake()
  c.rollout.temperature = c.loss.temperature = 1.0  # default.py explores at 1.3
  c.env.task_kwargs = {"sizes": (6,)}
  c.env.kwargs = {"neighbours": True}
  c.rollout.max_turns = 12
  # 12 turns of ~107 tokens (a 6x6 grid, the neighbour line, the move).
  c.sampler.cache_length = 1536
  c.sampler.attention_windows = (1536,)
  c.sampler.length_buckets = (96, 160)
  c.rl.buckets = (512, 1024, 1536)
  c.sft.num_demos = 256
  c.sft.steps = 200
  c.optim.total_steps = 200
  c.optim.learning_rate = 2e-3
  c.rl.credit = scheme
  if scheme == "gae":
    c.loss.value_coef = 0.5
  c.rl.tasks_per_iteration = 4
  c.rl_optim.learning_rate = 2e-4
  c.rl_optim.total_steps = 150
  c.iterations = 60
  c.eval_samples = 2
  c.env.num_eval_tasks = 64
  return c
