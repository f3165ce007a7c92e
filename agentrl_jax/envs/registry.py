"""Environment registry: `make(name, **kwargs)` and `registered()`.

A name is a registered one (`register(name, factory)`; the bundled
environments are registered by import path and imported on first use, so
importing `agentrl_jax.envs` stays cheap: no sandbox, no BM25 index), or an
import path to a class or factory outside the library:
`package.module:attr` (importable from the working directory or
PYTHONPATH) or `path/to/file.py:attr`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
from typing import Callable

from agentrl_jax.envs.base import Environment

_REGISTRY: dict[str, str | Callable[..., Environment]] = {
    "arithmetic": "agentrl_jax.envs.arithmetic:arithmetic_env",
    "search_qa": "agentrl_jax.envs.search_qa:SearchQAEnv",
    "search_qa_tools": "agentrl_jax.envs.search_qa:search_tool_env",
    "calculator": "agentrl_jax.envs.calculator:CalculatorEnv",
    "frozen_lake": "agentrl_jax.envs.frozen_lake:FrozenLakeEnv",
    "python_tool": "agentrl_jax.envs.python_tool:PythonToolEnv",
    "sokoban": "agentrl_jax.envs.sokoban:SokobanEnv",
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
  """The class (or factory) registered as `name`, or at import path `name`."""
  if name not in _REGISTRY:
    if ":" in name:
      return _load(name)
    raise ValueError(f"unknown environment {name!r}; registered: {registered()} (or "
                     "name one by import path, package.module:attr or file.py:attr)")
  entry = _REGISTRY[name]
  if isinstance(entry, str):
    entry = _REGISTRY[name] = _load(entry)
  return entry


def _load(path: str) -> Callable[..., Environment]:
  """`module:attr` or `file.py:attr` -> the attribute; ValueError naming the
  part that is missing."""
  module_name, _, attr = path.rpartition(":")
  if not module_name or not attr:
    raise ValueError(f"environment path {path!r} must be package.module:attr or file.py:attr")
  if module_name.endswith(".py"):
    file = pathlib.Path(module_name)
    if not file.is_file():
      raise ValueError(f"environment path {path!r}: no file {file}")
    spec = importlib.util.spec_from_file_location(f"_agentrl_env_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    if os.getcwd() not in sys.path:  # as `python -m` would: the working directory
      sys.path.append(os.getcwd())
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      raise ValueError(f"environment path {path!r}: cannot import {module_name} ({e}); is "
                       "its folder the working directory or on PYTHONPATH?") from None
  if not hasattr(module, attr):
    raise ValueError(f"environment path {path!r}: {module_name} has no {attr!r}")
  return getattr(module, attr)


def make(name: str, **kwargs) -> Environment:
  """A fresh instance (one per episode: instances are never shared)."""
  return env_class(name)(**kwargs)
