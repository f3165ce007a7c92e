"""Text environments with a Gymnasium-style contract (see base.py)."""

from agentrl_jax.envs.adapters import FromGymnasium, SeedStyle, TurnBudget, as_gymnasium
from agentrl_jax.envs.base import (
    REWARD_PARTS, Environment, Expert, StepResult, Task, TextEnvironment,
    reward_parts)
from agentrl_jax.envs.registry import env_class, make, register, registered
