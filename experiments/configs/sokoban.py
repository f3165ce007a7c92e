"""The long-horizon testbed: text Sokoban, sparse reward, SFT then RL.

  python experiments/train_agent.py --config=experiments/configs/sokoban.py:grpo \\
      --workdir=runs/sokoban_grpo

6x6 rooms (outer wall included) with one box whose shortest solution takes
at least 4 moves (`envs.sokoban`: reverse-play generation, BFS-verified, the
BFS solver as the SFT expert), one move a turn, up to 10 turns; a box
pushed into a corner off its target ends the episode (it can never be
solved). The reward is the outcome alone (1.0 when the box is on its
target) plus a format penalty for unparseable moves; GiGPO's anchors are
the room states (`SokobanEnv.state_key`). The string after ':' picks the
credit scheme (any registered name: grpo, turn_returns, gae, gigpo, ...).
Sized for `experiments/credit_ablation.py --env=sokoban --size=full` (8
seeds, one SFT each, 15 RL iterations of 4 rooms x 8 episodes per arm) on
2 CPU cores. Expect RL to lower SFT's held-out greedy success under every
scheme tried so far: the policy learns to walk into walls until the turn
budget ends the episode rather than risk a push. What it measured, and
how long it takes: docs/results.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import default  # pylint: disable=wrong-import-position


def get_config(scheme="grpo"):
  c = default.frozen_lake()
  c.rollout.temperature = c.loss.temperature = 1.0  # default.py explores at 1.3
  c.env.name = "sokoban"
  # A box cornered off its target ends the episode: its return is final, so
  # the turns left would only cost compute.
  c.env.kwargs = {"format_penalty": 0.1, "end_on_deadlock": True}
  c.env.task_kwargs = {"size": 6, "boxes": 1, "min_moves": 4}
  c.rollout.system_prompt = (
      "Push the box X onto the target O. # wall, _ floor, P you, S you on O. "
      "Move with <move>left|down|right|up</move>.")
  c.rollout.max_turns = 10
  # The prompt is 146 tokens and a turn about 70 (the 41-token room, the
  # position line, the move): 10 turns end by ~860.
  c.sampler.cache_length = 896
  c.sampler.attention_windows = (896,)
  c.sampler.length_buckets = (96, 160)
  c.rl.buckets = (512, 640, 768, 896)
  # SFT on every training room's expert episode, decayed to 10% of its lr
  # by its last step.
  c.sft.steps = 150
  c.sft.num_demos = 400
  c.optim.learning_rate = 2e-3
  c.optim.total_steps = 150
  c.rl.credit = scheme
  if scheme == "gae":
    c.loss.value_coef = 0.5
  c.rl.tasks_per_iteration = 4
  c.rl_optim.learning_rate = 1e-4
  c.rl_optim.total_steps = 60
  c.loss.ppo_epochs = 2
  c.iterations = 15
  c.eval_every = 15
  c.eval_samples = 2
  c.env.num_eval_tasks = 64
  return c
