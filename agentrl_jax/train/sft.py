"""SFT warm start: distil an environment's scripted expert into the policy.

Expert episodes go through the same RolloutEngine (expert mode), so the
prompt, observation and action tokens, their roles and masks are exactly the
ones RL will produce; the loss is the masked cross-entropy on ASSISTANT
tokens only. RL on a policy that cannot yet emit a tool call gets all-zero
rewards, a zero group-relative advantage, and learns nothing (reference
text); this is what gives it something to sharpen.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from agentrl_jax.envs.base import Task
from agentrl_jax.rollout import RolloutEngine
from agentrl_jax.train.state import TrainState
from agentrl_jax.train.step import SFTStep
from agentrl_jax.trajectory import Trajectory, collate, pack_batch


def expert_demos(engine: RolloutEngine, tasks: Sequence[Task], *,
                 keep_failed: bool = False) -> list[Trajectory]:
  """One expert episode per task: the successful ones, or every one with
  `keep_failed` (demonstrations that do not know what the reward pays, as
  FrozenLake's `demo_exits="either"`)."""
  trajs = engine.run(tasks, 1, expert=True).trajectories
  return [t for t in trajs if keep_failed or t.metadata["success"]]


def stop_at_success(success: Callable[[TrainState], float], *, target: float, every: int
                    ) -> Callable[[int, TrainState], bool]:
  """A `distill` stop: after every `every`-th update, True once
  `success(state)` (e.g. greedy success on validation tasks) reaches `target`.

  A fixed step count leaves one seed's policy reading its maps and another's
  walking one memorised path; stopping on a reached level starts RL from the
  same competence on every seed.
  """
  if every < 1:
    raise ValueError(f"every = {every} must be >= 1")
  return lambda i, state: (i + 1) % every == 0 and success(state) >= target


def distill(step: SFTStep, state: TrainState, demos: Sequence[Trajectory], *,
            steps: int, batch_size: int, buckets: Sequence[int], seed: int = 0,
            pack: bool = False, share_prompts: bool = False, row_multiple: int = 1,
            on_step: Callable[[int, dict], None] | None = None,
            stop: Callable[[int, TrainState], bool] | None = None) -> TrainState:
  """Up to `steps` SFT updates on minibatches drawn (seeded) from the demos.

  pack, share_prompts: each minibatch's rows packed as RL's
  (`trajectory.pack_batch`; shared prompts in rows of the largest bucket),
  in a multiple of `row_multiple` rows; the loss is the unpacked one.

  stop(i, state), called after update i (0-based), ends SFT there when it
  returns True (e.g. once the policy solves enough validation tasks).
  """
  if len(demos) < batch_size:
    raise ValueError(f"{len(demos)} successful expert demos < batch size {batch_size} (a "
                     "demo counts when its episode terminated and its last step "
                     "reported info['success'] True: agentrl_jax.envs.contract)")
  rng = np.random.default_rng(seed)
  order: list[int] = []
  for i in range(steps):
    if len(order) < batch_size:  # a fresh permutation per epoch
      order += list(rng.permutation(len(demos)))
    picked, order = order[:batch_size], order[batch_size:]
    batch = collate([demos[j] for j in picked], buckets=buckets,
                    require_logprobs=False)
    if pack:
      batch = pack_batch(batch, row_multiple, share_prompts=share_prompts,
                         row_length=max(buckets) if share_prompts else None)
    state, metrics = step(state, batch)
    if on_step is not None:
      on_step(i, {k: float(v) for k, v in jax.device_get(metrics).items()})
    if stop is not None and stop(i, state):
      break
  return state
