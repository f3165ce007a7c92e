"""Multi-token stop sequences, matched inside the jitted decode loop.

Stop sequences are token-id sequences (from strings via
`ChatFormat.stop_sequences`), right-aligned into a fixed [N, W] table so the
set can change between calls without recompiling. Each step the last W
tokens of every slot are compared against every row.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

_NEVER = -2  # fills the tail before any token is generated: matches no id


@flax.struct.dataclass
class StopTable:
  ids: jax.Array  # [N, W] int32, each sequence right-aligned, -1 left padding
  lengths: jax.Array  # [N] int32; 0 = unused row

  @classmethod
  def make(cls, sequences: Sequence[Sequence[int]], max_sequences: int,
           max_length: int) -> StopTable:
    if len(sequences) > max_sequences:
      raise ValueError(f"{len(sequences)} stop sequences > max {max_sequences}")
    ids = np.full((max_sequences, max_length), -1, np.int32)
    lengths = np.zeros(max_sequences, np.int32)
    for i, seq in enumerate(sequences):
      if not 0 < len(seq) <= max_length:
        raise ValueError(f"stop sequence {list(seq)} must have 1..{max_length} tokens")
      ids[i, max_length - len(seq):] = seq
      lengths[i] = len(seq)
    return cls(ids=jnp.asarray(ids), lengths=jnp.asarray(lengths))


def empty_tail(batch: int, width: int) -> jax.Array:
  """[B, W] tail buffer with nothing generated yet."""
  return jnp.full((batch, width), _NEVER, jnp.int32)


def push(tail: jax.Array, tokens: jax.Array) -> jax.Array:
  """Shifts tokens [B] in as the newest (rightmost) entry of tail [B, W]."""
  return jnp.concatenate([tail[:, 1:], tokens[:, None]], axis=1)


def matches(tail: jax.Array, table: StopTable) -> jax.Array:
  """[B] bool: the newest tokens of a slot end with some stop sequence.

  Only tokens generated in this call are in the tail (it starts at
  `empty_tail`), so a stop needs all its tokens sampled by this action.
  """
  width = table.ids.shape[1]
  in_seq = jnp.arange(width)[None, :] >= width - table.lengths[:, None]  # [N, W]
  equal = tail[:, None, :] == table.ids[None]  # [B, N, W]
  hit = jnp.all(equal | ~in_seq[None], axis=-1) & (table.lengths > 0)[None]
  return jnp.any(hit, axis=-1)
