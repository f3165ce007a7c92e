"""Rollouts: many multi-turn episodes at once on the sampler's slots.

- `episode.py`: one episode's turn loop as a state machine (prompt, sample,
  call the environment, observe) and its record, a `Trajectory` whose ids
  are exactly what the sampler consumed and produced.
- `scheduler.py`: the slot scheduler (admission, cohorts, lockstep, env
  calls in threads under deadlines, isolation for evaluation).
- `groups.py`: the group queue (complete groups out, the rest carried).
- `branching.py`: continuations from recorded states (replay, kept caches).
- `engine.py`: `RolloutEngine`, which puts them together (partial
  rollouts, expert mode); `stats.py`: a call's metrics.
"""

from agentrl_jax.rollout.config import RolloutConfig
from agentrl_jax.rollout.engine import RolloutEngine, RolloutResult
from agentrl_jax.rollout.episode import STOP_REASONS, TRUNCATION_MARKER
