"""Text environments with a Gymnasium-style contract (see base.py).

The bundled environments (`search_qa`, `calculator`, `frozen_lake`,
`python_tool`) are created through the registry, `make(name, **kwargs)`.
Model-written code runs only in `sandbox.Sandbox`.
"""

from agentrl_jax.envs.adapters import FromGymnasium, SeedStyle, TurnBudget, as_gymnasium
from agentrl_jax.envs.base import (
    EPISODE_OVER, REWARD_PARTS, Environment, Expert, StepResult, Task, TextEnvironment,
    reward_parts, strip_think, tool_call)
from agentrl_jax.envs.registry import env_class, make, register, registered
from agentrl_jax.envs.sandbox import Sandbox, SandboxResult
