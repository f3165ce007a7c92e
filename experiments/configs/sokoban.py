"""The long-horizon testbed: text Sokoban, sparse reward, SFT then RL.

  python experiments/train_agent.py --config=experiments/configs/sokoban.py:grpo \\
      --workdir=runs/sokoban_grpo

6x6 rooms with one box whose shortest solution takes at least 6 moves
(`envs.sokoban`: reverse-play generation, BFS-verified, the BFS solver as
the SFT expert), one move a turn, up to 20 turns: an episode is 6-20
turns and a box pushed into a corner early dooms it. The reward is the
outcome alone (1.0 when the box is on its target) plus a format penalty
for unparseable moves; GiGPO's anchors are the room states
(`SokobanEnv.state_key`). The string after ':' picks the credit scheme
(any registered name: grpo, turn_returns, gae, gigpo, ...). Measured so
far (3 RL iterations, docs/results.md "Sokoban, a first look"): SFT leaves held-out
success at 0.125 greedy; a full run is yet to be made.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import default  # pylint: disable=wrong-import-position


def get_config(scheme="grpo"):
  c = default.get_config()
  c.env.name = "sokoban"
  c.env.kwargs = {"format_penalty": 0.1}
  c.env.task_kwargs = {"size": 6, "boxes": 1, "min_moves": 6}
  c.rollout.system_prompt = (
      "Push the box X onto the target O. # wall, _ floor, P you. "
      "Move with <move>left|down|right|up</move>.")
  c.rollout.max_turns = 20
  # About 85 tokens a turn (the room is redrawn each turn): 20 turns fit.
  c.sampler.cache_length = 2048
  c.sampler.attention_windows = (2048,)
  c.sampler.length_buckets = (128, 256)
  c.rl.buckets = (512, 1024, 2048)
  c.rl.credit = scheme
  if scheme == "gae":
    c.loss.value_coef = 0.5
  c.env.num_eval_tasks = 64
  # What the first look ran with (default.py's values then).
  c.sft.steps = 150
  c.rl_optim.learning_rate = 5e-5
  c.loss.ppo_epochs = 1
  return c
