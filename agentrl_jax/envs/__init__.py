"""Text environments with a Gymnasium-style contract (see base.py).

What an environment must declare is in `contract.py` (checked when an
engine or a run is built). The bundled environments (`search_qa`,
`calculator`, `arithmetic`, `frozen_lake`, `sokoban`, `python_tool`) are
created through the registry, `make(name, **kwargs)`; `register(name,
factory)` adds one, and a config may name any by import path
(`package.module:attr` or `path/to/file.py:attr`). `ToolEnv` turns Python
functions into JSON tools. Model-written code runs only in
`sandbox.Sandbox`.
"""

from agentrl_jax.envs.adapters import FromGymnasium, SeedStyle, TurnBudget, as_gymnasium
from agentrl_jax.envs.base import (
    EPISODE_OVER, REWARD_PARTS, Environment, Expert, StepResult, Task, TextEnvironment,
    reward_parts, strip_think, tool_call)
from agentrl_jax.envs.contract import ContractError, EnvSpec, check
from agentrl_jax.envs.registry import env_class, make, register, registered
from agentrl_jax.envs.tool_env import ToolEnv, load_tasks
from agentrl_jax.envs.sandbox import Sandbox, SandboxResult
