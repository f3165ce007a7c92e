"""The embedded default: the tiny model learns text FrozenLake, SFT then RL.

  python experiments/train_agent.py --config=experiments/configs/default.py \\
      --workdir=runs/default

A 2-layer, d=128 model with the bundled tokenizer, trained from scratch on
2 CPU cores. Each 4x4 map has FrozenLake's goal G in the bottom-right
corner and a second exit, a door D, in the top-right or bottom-left one:
the door ends the episode unpaid. The scripted expert (BFS shortest path)
leaves by G or by D, a fair coin per map, like demonstrators who did not
know which exit pays; SFT imitates all of its episodes on 64 maps (150
steps), so the policy learns to read the map and walk to an exit, but not
which exit. RL (GRPO on the outcome reward, 8 rollouts per map, 8 maps
an iteration sampled at temperature 1, 40 iterations of two optimizer
steps per batch at 2e-4) learns which one from the reward. The agent reads the grid each
turn and answers with <move>left|down|right|up</move>.

`--config=experiments/configs/default.py:plain` runs plain FrozenLake
(`frozen_lake()`), the main command's earlier task.

It prints held-out success on 128 unseen maps (greedy, and at temperature 1
with 4 episodes per map) after SFT and after RL. Other seeds:
`--config.seed=K`. What this command measured, per seed and per machine
type: README.md ("Two commands") and docs/results.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # pylint: disable=wrong-import-position


def frozen_lake():
  """Plain text FrozenLake (G the only exit, SFT on the expert's shortest
  paths, 60 RL iterations): the main command's earlier task, and the base
  of the FrozenLake and Sokoban ablation configs and of the benchmarks,
  whose recorded runs it reproduces."""
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
  # Rollouts explore at 1.3 (at 1.0 RL sharpened fewer seeds' greedy
  # policies: docs/results.md, session 31), and the loss trains that
  # distribution, softmax(logits / 1.3): its ratios are those of the policy
  # that sampled.
  c.rollout.temperature = c.loss.temperature = 1.3
  # Larger steps than a fine-tune of a real model; at 6e-4 RL fell from
  # these SFT starts (docs/results.md, session 22).
  c.rl_optim.learning_rate = 2e-4
  c.rl_optim.total_steps = 150
  c.loss.ppo_epochs = 2
  c.env.num_eval_tasks = 128
  # Few demonstrations, seen often: every seed's SFT policy reads the maps
  # (75 steps on 256 left one seed walking a fixed path RL never left).
  c.sft.num_demos = 64
  c.sft.steps = 150
  c.iterations = 60
  return c


def get_config(task: str = "door"):
  """The door task; `default.py:plain` picks `frozen_lake()`."""
  if task == "plain":
    return frozen_lake()
  if task != "door":
    raise ValueError(f"unknown task {task!r}: door (the default) or plain")
  c = frozen_lake()
  c.env.task_kwargs = {"sizes": (4,), "decoy": True}
  c.env.kwargs = {"demo_exits": "either"}
  # All the demonstrations: the half that leave by the door too.
  c.sft.keep_failed = True
  # The SFT policy is unsure of the exit already, so rollouts sample the
  # temperature-1 policy: at 1.3, with the loss at 1, seed 2's entropy rose
  # from 0.3 to 3 (docs/results.md, session 35).
  c.rollout.temperature = c.loss.temperature = 1.0
  # RL's held-out gain is made by about iteration 30 (docs/results.md,
  # session 35).
  c.iterations = 40
  c.rl_optim.total_steps = 100
  return c
