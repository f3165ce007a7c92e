"""SearchQA (ReAct over a fictional corpus, BM25), with a 1-hop -> 2-hop curriculum.

  python experiments/train_agent.py --config=experiments/configs/search_qa.py \
      --workdir=runs/search_qa

Not yet tuned or measured at the tiny size: copying entity names out of the
observations needs far more SFT than the FrozenLake default.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # pylint: disable=wrong-import-position


def get_config():
  c = base.get_config()
  c.env.name = "search_qa"
  c.env.kwargs = {"process_bonus": 0.1}
  c.rollout.system_prompt = ("Answer with <search>query</search> and then "
                             "<answer>answer</answer>.")
  c.rollout.max_turns = 4
  c.rollout.max_action_tokens = 32
  c.rollout.max_observation_tokens = 160
  c.sampler.cache_length = 1024
  c.rl.buckets = (256, 512, 1024)
  c.curriculum = ((0, (0,)), (30, (0, 1)))  # 1-hop first, then 2-hop mixed in
  c.sft.steps = 400
  return c
