"""Environment registry: `make(name, **kwargs)` and `registered()`.

Bundled environments are registered by import path and imported on first
use, so importing `agentrl_jax.envs` stays cheap (no sandbox, no BM25 index).
"""

from __future__ import annotations

import importlib
from typing import Callable

from agentrl_jax.envs.base import Environment

_REGISTRY: dict[str, str | Callable[..., Environment]] = {
    "search_qa": "agentrl_jax.envs.search_qa:SearchQAEnv",
    "calculator": "agentrl_jax.envs.calculator:CalculatorEnv",
    "frozen_lake": "agentrl_jax.envs.frozen_lake:FrozenLakeEnv",
    "python_tool": "agentrl_jax.envs.python_tool:PythonToolEnv",
}


def register(name: str, factory: Callable[..., Environment], *,
             overwrite: bool = False) -> None:
  """Registers a class or factory under `name`."""
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"environment {name!r} is already registered")
  _REGISTRY[name] = factory


def registered() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def env_class(name: str) -> Callable[..., Environment]:
  """The class (or factory) registered as `name`."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; registered: {registered()}")
  entry = _REGISTRY[name]
  if isinstance(entry, str):
    module, attr = entry.split(":")
    entry = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
  return entry


def make(name: str, **kwargs) -> Environment:
  """A fresh instance (one per episode: instances are never shared)."""
  return env_class(name)(**kwargs)
