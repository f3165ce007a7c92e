"""Keep-last-k checkpoints of a training-state pytree plus a JSON side dict.

A thin wrapper over `orbax.checkpoint.CheckpointManager` so the training
script names only what it saves (`state`, `extra`), never orbax's args.
Each step is a directory `<directory>/<step>/` holding `state/` (arrays) and
`extra/` (JSON: counters, config, data-loader position).

Orbax 0.12.8 stores typed PRNG keys (`jax.random.key`, any impl, and the
`RngKey` variables inside `nnx.state`) natively and restores them as typed
keys of the same impl, so keys need no `key_data`/`wrap_key_data` round trip.

Saves are asynchronous: `save` returns once the arrays are in host memory
and the write to disk finishes in the background; `restore` and `close`
wait for it first. Donating them to the next train step is safe: off a CPU
they are copies, and on a CPU backend they are views of the buffers, which
jax then does not donate (the step writes fresh ones until the write lets
go). The write's own host memory (tensorstore's encoded chunks) grows with
what is in flight, up to about the state's size when nothing bounds it;
`write_gb` bounds it.

A checkpoint that cannot be read (a truncated file after a crash or a full
disk) raises `CorruptCheckpointError` naming its directory and the other
steps on disk; `restore_latest` warns and takes the newest intact one.
"""

from __future__ import annotations

import os
from typing import Any
import warnings

import jax
import orbax.checkpoint as ocp


def _shard_bytes(x) -> int:
  """Bytes of the largest piece of `x` a save writes at once (one shard)."""
  if isinstance(x, jax.Array):
    return max(s.data.nbytes for s in x.addressable_shards)
  return int(getattr(x, "nbytes", 0))


class CorruptCheckpointError(RuntimeError):
  """A saved step that cannot be read back."""


class Checkpointer:
  """Saves and restores `(state_pytree, extra_dict)` by integer step."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3,
               write_gb: float | None = None):
    """write_gb: at most this many GB (1e9 bytes) of arrays being written at
    once (orbax's `save_concurrent_gb`), which bounds the host memory a save
    takes beyond the state; it must exceed the largest array (a shard of
    it, under a mesh). None: orbax's default (96)."""
    if write_gb is not None and not write_gb > 0:
      raise ValueError(f"write_gb must be > 0 (or None), got {write_gb!r}")
    # Orbax resolves paths itself; an absolute path keeps a later chdir safe.
    self.directory = os.path.abspath(os.fspath(directory))
    self.write_gb = write_gb
    handlers = None if write_gb is None else {
        "state": ocp.StandardCheckpointHandler(save_concurrent_gb=write_gb),
        "extra": ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep),
        item_handlers=handlers)

  def save(self, step: int, state: Any, extra: dict | None = None) -> None:
    """Starts saving `state` (any pytree of arrays) and `extra` (JSON) at `step`.

    Deletes the oldest checkpoints beyond `max_to_keep` once this one commits.
    Raises ValueError, before writing anything, when an array is larger than
    `write_gb` (orbax would fail in the middle of the write).
    """
    if self.write_gb is not None:
      largest = max((_shard_bytes(x) for x in jax.tree.leaves(state)), default=0)
      if largest >= self.write_gb * 1e9:
        raise ValueError(
            f"an array of the state takes {largest / 1e9:.3g} GB, more than the "
            f"checkpoint's write_gb = {self.write_gb}: raise it above the largest array")
    self._manager.save(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        extra=ocp.args.JsonSave(dict(extra or {}))))

  def latest_step(self) -> int | None:
    """The newest saved step (including one still being written), or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps on disk, oldest first."""
    return sorted(self._manager.all_steps())

  def saved_tree(self, step: int) -> dict:
    """The structure `state` was saved with at `step`, read from its metadata
    (no arrays loaded): a nested dict whose leaves are orbax's array
    metadata, and None where the state held None (e.g. no KL reference)."""
    self.wait()
    metadata = ocp.StandardCheckpointHandler().metadata(
        ocp.path.step.build_step_path(self.directory, ocp.path.step.standard_name_format(), step)
        / "state")
    return metadata.tree

  def restore(self, step: int | None = None, *,
              abstract_state: Any) -> tuple[Any, dict]:
    """Loads `(state, extra)` saved at `step` (default: the latest).

    abstract_state: a pytree with the saved structure whose leaves are arrays
      or `jax.ShapeDtypeStruct`s (e.g. `jax.eval_shape(init_fn)`); the restored
      leaves take their dtypes and shardings (a struct without a sharding
      lands on the default device), so `sharding.abstract_state` restores a
      state saved on one mesh straight onto another.
    """
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
    try:
      restored = self._manager.restore(int(step), args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state),
          extra=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      others = [s for s in self.all_steps() if s != step]
      raise CorruptCheckpointError(
          f"checkpoint {os.path.join(self.directory, str(step))} cannot be read "
          f"({type(e).__name__}: {e}); other steps on disk: {others or 'none'} "
          f"(restore(step=...) one, or restore_latest() takes the newest intact "
          f"one)") from e
    return restored["state"], dict(restored["extra"])

  def restore_latest(self, *, abstract_state: Any) -> tuple[int, Any, dict]:
    """`(step, state, extra)` of the newest step that reads back; warns for
    each newer one that does not. Raises FileNotFoundError with no steps,
    CorruptCheckpointError when even the oldest does not read back."""
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    for step in reversed(steps[1:]):
      try:
        return (step, *self.restore(step, abstract_state=abstract_state))
      except CorruptCheckpointError as e:
        warnings.warn(f"{e}; trying the step before it", RuntimeWarning, stacklevel=2)
    return (steps[0], *self.restore(steps[0], abstract_state=abstract_state))

  def wait(self) -> None:
    """Blocks until every save started so far is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self.wait()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
