"""The default FrozenLake run with per-turn credit instead of trajectory GRPO.

  python experiments/train_agent.py \
      --config=experiments/configs/frozen_lake_turn_credit.py:turn_grpo \
      --workdir=runs/fl_turn_grpo

The config string after ':' picks the scheme: turn_returns (discounted
return-to-go), turn_grpo (group-normalised return-to-go), gae (value head,
GAE over turns), branching (Monte-Carlo values from `rl.branch_size`
continuations sampled before every turn; several times the rollout cost)
or gigpo (GRPO plus turn-level advantages over the turns a group's
rollouts took from the same cell). The shaped reward (0.1 per cell closer
to G) gives per-turn signal to assign.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import default  # pylint: disable=wrong-import-position


def get_config(scheme="turn_grpo"):
  c = default.frozen_lake()
  c.rollout.temperature = c.loss.temperature = 1.0  # default.py explores at 1.3
  c.env.kwargs = {"shaped_reward": 0.1}
  c.rl.credit = scheme
  c.rl.gamma = 0.9
  if scheme == "gae":
    c.loss.value_coef = 0.5
  return c
