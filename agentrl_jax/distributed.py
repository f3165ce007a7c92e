"""Multi-host (multi-process) training: one JAX process per host.

Start every process with `initialize(...)` before any other JAX call; then
`jax.devices()` lists every host's devices and a `sharding.make_mesh` mesh
over them is the *global* mesh the train step runs on.

The split of work:
- Rollouts are per host. Each process samples on a *local* mesh over its own
  devices (`local_mesh`), so the turn-by-turn Python control flow, which
  differs from host to host, never needs the others in lockstep, and runs
  its own environments on its share of the tasks (`task_share`; the task
  list is seeded, so the same on every host).
- Training is global. Each process collates and assigns credit to its own
  trajectories; `global_batch` assembles the [B, L] batch from every
  process's rows (each host contributes its rows to its own devices, nothing
  goes through host 0). Row counts and the bucket length are agreed first
  (`agree_max`), so every host contributes the same static shape.
- Weight sync: `to_local` reshards the global parameters straight onto each
  process's local sampler layout, device to device (one collective), without
  a host copy and without a full copy per device.
- Metrics: per-host scalars are combined with `combine`; only the primary
  process (`is_primary`) writes files.

Every helper is the identity with one process, so single-host code paths run
unchanged through them.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
import numpy as np

from agentrl_jax import sharding
from agentrl_jax.trajectory import TokenBatch


def initialize(coordinator: str = "", num_processes: int = 1, process_id: int = 0) -> None:
  """Joins this process to the others: call it first, before any JAX call.

  An empty `coordinator` calls `jax.distributed.initialize()` without
  arguments: on a TPU VM slice, or a cluster JAX detects (SLURM, Open MPI,
  Kubernetes), every process finds the coordinator and its own id itself.
  Otherwise pass "host:port" of process 0 plus the count and this id (as
  for several CPU processes on one machine, which is how the tests run).
  """
  # CPU devices of different processes talk through gloo (no effect on
  # TPU or GPU, whose collectives are their own).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if coordinator:
    jax.distributed.initialize(coordinator_address=coordinator,
                               num_processes=num_processes, process_id=process_id)
  else:
    jax.distributed.initialize()


def is_primary() -> bool:
  """Whether this process writes metrics, plots and summaries."""
  return jax.process_index() == 0


def task_share(items: Sequence[Any]) -> list[Any]:
  """This process's share of `items` (every process_count-th, from its index)."""
  return list(items[jax.process_index()::jax.process_count()])


def local_mesh(cfg: sharding.MeshConfig) -> Mesh:
  """The sampler's mesh over this process's devices, shaped like the global
  one (`sharding.mesh_like`)."""
  return sharding.mesh_like(cfg, jax.local_devices())


def agree_max(values: Sequence[int]) -> np.ndarray:
  """[k] int64: the elementwise maximum of `values` over all processes."""
  local = np.asarray(values, np.int64)
  if jax.process_count() == 1:
    return local
  return np.asarray(multihost_utils.process_allgather(local)).max(axis=0)


def combine(values: dict[str, float], weight: float, *, sums: Sequence[str] = (),
            maxima: Sequence[str] = ()) -> dict[str, float]:
  """Per-process scalars -> their value over all processes.

  Keys in `sums` add up, keys in `maxima` take the maximum, every other key
  is a mean weighted by each process's `weight` (e.g. its episode count).
  Every process must pass the same keys.
  """
  if jax.process_count() == 1:
    return dict(values)
  keys = sorted(values)
  local = np.asarray([weight] + [values[k] for k in keys], np.float64)
  rows = np.asarray(multihost_utils.process_allgather(local))  # [P, 1 + k]
  w = rows[:, 0]
  out = {}
  for i, k in enumerate(keys, start=1):
    col = rows[:, i]
    if k in sums:
      out[k] = float(col.sum())
    elif k in maxima:
      out[k] = float(col.max())
    else:
      out[k] = float((col * w).sum() / max(w.sum(), 1e-12))
  return out


def global_batch(local: TokenBatch, batch_sharding: NamedSharding | None) -> TokenBatch:
  """Every process's [B / P, L] rows -> the global [B, L] batch on its mesh.

  Each process calls it with its own rows (the same shape everywhere, seq
  ids numbering its own trajectories from 0); they land on its own devices,
  in process order, with process p's seq ids moved up by p x B / P x L so
  that no two processes' sequences share an id (per-sequence loss modes sum
  by id; a process's ids must be below B / P x L, which holds for ids
  numbered from 0, one sequence taking at least one token, packed rows
  included). With one process the local batch is returned as is (the step
  places it).
  """
  if jax.process_count() == 1:
    return local
  first_id = jax.process_index() * local.seq_ids.size
  local = local.replace(seq_ids=np.where(local.seq_ids >= 0, local.seq_ids + first_id, -1))

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(
        batch_sharding, x, (x.shape[0] * jax.process_count(), *x.shape[1:]))
  return jax.tree.map(put, local)


def local_rows(x: jax.Array) -> np.ndarray:
  """This process's rows of a row-sharded [B, ...] array, in row order."""
  if x.is_fully_addressable:
    return np.asarray(x)
  blocks = {s.index[0].start or 0: s.data for s in x.addressable_shards}  # replicas once
  return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)])


def _stacked(local: NamedSharding) -> NamedSharding:
  """`local` (on this process's mesh) as one sharding over every process.

  A ("process", *axes) mesh whose p-th slice is process p's copy of the
  local mesh (the same positions of its own devices), with the same spec:
  an array with this sharding holds, on each process, exactly the array
  `local` describes.
  """
  mesh = local.mesh
  position = {d: i for i, d in enumerate(jax.local_devices())}
  index = np.vectorize(lambda d: position[d], otypes=[int])(mesh.devices)
  per_process: dict[int, list[jax.Device]] = {}
  for d in jax.devices():
    per_process.setdefault(d.process_index, []).append(d)
  devices = np.stack([np.asarray(per_process[p], dtype=object)[index]
                      for p in sorted(per_process)])
  return NamedSharding(Mesh(devices, ("process", *mesh.axis_names),
                            axis_types=(AxisType.Auto, *mesh.axis_types)), local.spec)


def to_local(tree: Any, shardings: Any) -> Any:
  """Global arrays -> this process's arrays with `shardings` (a local mesh's).

  One device-to-device reshard of the whole tree onto `_stacked` shardings
  (XLA moves only what each device lacks; there is no host copy and no full
  replica per device), then each process wraps its own shards as a local
  array. Every process must call it (a collective). The result never
  aliases `tree`, so donating `tree` afterwards is safe.
  """
  stacked = jax.tree.map(_stacked, shardings)
  moved = jax.device_put(tree, stacked, may_alias=False)
  return jax.tree.map(
      lambda x, s: jax.make_array_from_single_device_arrays(
          x.shape, s, [shard.data for shard in x.addressable_shards]),
      moved, shardings)
