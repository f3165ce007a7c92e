"""Text environments with a Gymnasium-style contract (see base.py)."""

from agentrl_jax.envs.base import (
    REWARD_PARTS, Environment, Expert, StepResult, Task, TextEnvironment,
    reward_parts)
