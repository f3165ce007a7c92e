"""What a train step needs in memory, known before any work is done.

A run that does not fit dies mid-run at its first long batch, killed by the
kernel with no message (or by the accelerator's allocator). The step's own
programs say what it needs: `step_memory` compiles them on abstract inputs
of the largest shape the run will feed (nothing is allocated) and reads
XLA's buffer assignment. The estimate is

  resident (the train state's arrays, plus what else the run holds through
  the step, e.g. the sampler's KV cache) + the temporaries of the step's
  largest program (activations, gradients, the optimizer update)

at the configured micro-batching. `fit_micro_batches` tries more
micro-batches (exact gradient accumulation: the update is the same) until
the estimate fits a budget, or raises `MemoryBudgetError` with every
estimate it made. The budget defaults to the device's memory limit, or the
host's physical memory on a CPU (`memory_budget_gib`).

The estimate is the compiler's; what a process holds beyond it (the
runtime, the compiler's own working memory, the host heap's free pages,
a checkpoint write in flight) is not in it: leave a margin.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import numpy as np

from agentrl_jax.trajectory import abstract_batch

GIB = 2**30


class MemoryBudgetError(ValueError):
  """A run whose train step would not fit its memory budget."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """One step's estimate at one micro-batching, in GiB."""

  micro_batches: int
  rows: int
  length: int
  state_gib: float  # the train state's arrays
  other_gib: float  # what else stays resident through the step
  temp_gib: float  # XLA's temporaries of the step's largest program

  @property
  def total_gib(self) -> float:
    return self.state_gib + self.other_gib + self.temp_gib

  def describe(self) -> str:
    return (f"{self.total_gib:.2f} GiB at micro_batches={self.micro_batches} "
            f"({self.rows} rows x {self.length} tokens: state {self.state_gib:.2f} + "
            f"resident {self.other_gib:.2f} + step temporaries {self.temp_gib:.2f})")


def tree_gib(tree) -> float:
  """GiB of a pytree's arrays on one device (a sharded array counts its
  shard; abstract leaves count whole)."""
  def nbytes(x):
    shape = x.sharding.shard_shape(x.shape) if isinstance(x, jax.Array) else x.shape
    return int(np.prod(shape)) * x.dtype.itemsize
  return sum(map(nbytes, jax.tree.leaves(tree))) / GIB


def memory_budget_gib(memory_gb: float = 0.0) -> float:
  """`memory_gb` when > 0; else the first local device's memory limit where
  the backend reports one (GPU, TPU), else the host's physical memory (only a
  process's own devices report their memory)."""
  if memory_gb > 0:
    return float(memory_gb)
  stats = jax.local_devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return stats["bytes_limit"] / GIB
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def step_memory(step, state, *, rows: int, length: int, num_actions: int | None = None,
                other_gib: float = 0.0) -> StepMemory:
  """The estimate for `step` (an `RLStep` or `SFTStep`: anything with
  `lower(state, batch, num_actions) -> {name: Lowered}` and `micro_batches`
  or `cfg.micro_batches`) on [rows, length] batches.

  num_actions: the action bucket; None: every position (the most a batch of
  this shape can ask for).
  """
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  programs = step.lower(abstract, abstract_batch(rows, length), num_actions or length)
  temp = max(p.compile().memory_analysis().temp_size_in_bytes for p in programs.values())
  micro = getattr(step, "micro_batches", None) or step.cfg.micro_batches
  return StepMemory(micro_batches=micro, rows=rows, length=length,
                    state_gib=tree_gib(state), other_gib=other_gib, temp_gib=temp / GIB)


def fit_micro_batches(make_step: Callable[[int], Any], state, *, rows: int, length: int,
                      budget_gib: float, micro_batches: int, multiple_of: int | None = None,
                      other_gib: float = 0.0, what: str = "the train step"
                      ) -> StepMemory:
  """The estimate at the fewest micro-batches, from `micro_batches` up by
  doubling, that fits `budget_gib`; `make_step(n)` builds the step at n.

  Candidates divide `rows` (and `multiple_of`, the row count's granularity
  where batches vary: packed rows); more micro-batches than rows cannot
  help. Raises MemoryBudgetError naming each estimate when none fits.
  """
  multiple_of = multiple_of or rows
  tried = []
  n = micro_batches
  while n <= rows:
    if rows % n == 0 and multiple_of % n == 0:
      est = step_memory(make_step(n), state, rows=rows, length=length, other_gib=other_gib)
      if est.total_gib <= budget_gib:
        return est
      tried.append(est)
    n *= 2
  if not tried:
    raise MemoryBudgetError(f"{what}: micro_batches={micro_batches} does not divide {rows} "
                            "rows")
  raise MemoryBudgetError(
      f"{what} needs more than its memory budget of {budget_gib:.2f} GiB (memory_gb, or the "
      f"machine's): " + "; ".join(e.describe() for e in tried) + ". Shorten the rows "
      "(buckets, max_action_tokens, max_turns), use fewer rows a step, turn on "
      "model.remat, train LoRA adapters, or shard over more devices")
