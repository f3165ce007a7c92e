"""Stops matched on the text the tokens spell, inside the jitted decode loop.

A real BPE spells one stop string in several ways: Qwen2.5 writes
`</search>` as `</` `search` `>`, but `</search>` then a newline as `</`
`search` `>\\n`, so no single token sequence catches every spelling. A
`StopMatcher` is an Aho-Corasick automaton over the stop strings' UTF-8
bytes, folded over every token's bytes into one step per token:

  class = token_class[token]                 # [V]: tokens of equal effect
  hit   = stop_hit[state, class]             # a stop completed in this token
  state = next_state[state, class]           # [states, classes]

so a decode step advances every slot with two gathers. Most tokens share
one class ("back to the start, no stop"), which keeps the tables small. A
stop that completes inside a token (`>\\n`) stops after that token, and the
action keeps the whole token: ids are never re-encoded. Token ids in
`stop_ids` (the tokenizer's EOS, a chat format's end-of-turn) stop whatever
the strings; other special tokens spell no text and reset the automaton.
Matching starts afresh with each action: a stop counts only when the
action's own tokens complete it.

The same matcher also runs on token ids as symbols (`from_token_sequences`),
for stops given as id sequences. `scan` runs the tables in NumPy, so the
jitted path can be tested against it and it against `str.find`.
"""

from __future__ import annotations

import collections
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class StopTables:
  """The matcher's arrays, padded to the sampler's fixed shapes (a pytree)."""
  token_class: jax.Array  # [V] int32
  next_state: jax.Array  # [S, C] int32
  stop_hit: jax.Array  # [S, C] bool


def advance(tables: StopTables, state: jax.Array, tokens: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
  """(new state [B], stop completed [B]) after `tokens` [B] from `state` [B]."""
  cls = tables.token_class[tokens]
  return tables.next_state[state, cls], tables.stop_hit[state, cls]


class StopMatcher:
  """Stop strings (and stop ids) over a vocabulary; see the module doc.

  token_symbols: per token id, the symbols it spells (its bytes), or None
    for a special token that spells no text.
  patterns: symbol sequences that stop (non-empty).
  stop_ids: token ids that always stop.
  alphabet: the number of distinct symbols (256 for bytes).
  """

  def __init__(self, token_symbols: Sequence[Sequence[int] | None],
               patterns: Sequence[Sequence[int]], stop_ids: Sequence[int] = (), *,
               alphabet: int = 256):
    if any(len(p) == 0 for p in patterns):
      raise ValueError("stop strings must be non-empty")
    self.vocab_size = len(token_symbols)
    stop_ids = sorted({int(t) for t in stop_ids})
    if any(not 0 <= t < self.vocab_size for t in stop_ids):
      raise ValueError(f"stop ids {stop_ids} outside the vocabulary of {self.vocab_size}")
    delta, terminal = _aho_corasick(patterns, alphabet)
    num_states = delta.shape[0]
    # Each token's effect from every state, [next states | hits]: only tokens
    # with a symbol of some pattern can do anything but reset.
    used = np.zeros(alphabet, bool)
    used[[symbol for p in patterns for symbol in p]] = True
    by_length = collections.defaultdict(list)
    for token, symbols in enumerate(token_symbols):
      if symbols and token not in stop_ids and used[list(symbols)].any():
        by_length[len(symbols)].append(token)
    tokens = [np.asarray(stop_ids, np.int64)]
    effects = [np.tile(np.r_[np.zeros(num_states), np.ones(num_states)], (len(stop_ids), 1))]
    for length, group in by_length.items():
      symbols = np.asarray([list(token_symbols[t]) for t in group], np.int64)  # [n, L]
      state = np.broadcast_to(np.arange(num_states), (len(group), num_states))
      hit = np.zeros(state.shape, bool)
      for j in range(length):
        state = delta[state, symbols[:, j:j + 1]]
        hit |= terminal[state]
      tokens.append(np.asarray(group, np.int64))
      effects.append(np.concatenate([state, hit], axis=1))
    # Tokens of equal effect share a class; class 0 (row 0 here) is the reset.
    rows = np.ascontiguousarray(np.concatenate(
        [np.zeros((1, 2 * num_states))] + effects).astype(np.int32))
    keys = rows.view(np.dtype((np.void, 4 * 2 * num_states))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first)  # classes in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    self.token_class = np.zeros(self.vocab_size, np.int32)
    self.token_class[np.concatenate(tokens)] = rank[inverse.ravel()[1:]]
    table = rows[first[order]].T  # [2S, C]
    self.next_state = table[:num_states]
    self.stop_hit = table[num_states:].astype(bool)
    self._tables = {}

  @property
  def num_states(self) -> int:
    return self.next_state.shape[0]

  @property
  def num_classes(self) -> int:
    return self.next_state.shape[1]

  @classmethod
  def from_strings(cls, tokenizer, strings: Sequence[str], stop_ids: Sequence[int] = (),
                   vocab_size: int | None = None) -> StopMatcher:
    """Matches `strings` on the text of `tokenizer`'s tokens (see `token_bytes`);
    ids past the tokenizer's vocabulary, up to `vocab_size`, spell nothing."""
    symbols = token_bytes(tokenizer)
    if vocab_size is not None:
      symbols += [None] * (vocab_size - len(symbols))
    return cls(symbols, [s.encode("utf-8") for s in strings], stop_ids)

  @classmethod
  def from_token_sequences(cls, sequences: Sequence[Sequence[int]],
                           vocab_size: int) -> StopMatcher:
    """Stops given as token-id sequences: the ids themselves are the symbols."""
    return cls([(t,) for t in range(vocab_size)], [tuple(map(int, s)) for s in sequences],
               alphabet=vocab_size)

  def scan(self, token_ids: Sequence[int]) -> int:
    """Index of the first token at which a stop completes, or -1."""
    state = 0
    for i, token in enumerate(token_ids):
      cls = self.token_class[token]
      if self.stop_hit[state, cls]:
        return i
      state = self.next_state[state, cls]
    return -1

  def tables(self, max_states: int, max_classes: int, vocab_size: int) -> StopTables:
    """The arrays padded to [max_states, max_classes] and `vocab_size` ids
    (fixed shapes: another stop set never recompiles the decode)."""
    if self.num_states > max_states or self.num_classes > max_classes:
      raise ValueError(
          f"the stops need {self.num_states} automaton states and {self.num_classes} "
          f"token classes; the sampler holds {max_states} and {max_classes} "
          "(raise max_stop_states / max_stop_classes)")
    if vocab_size < self.vocab_size:
      raise ValueError(f"the stops cover {self.vocab_size} token ids, the model "
                       f"only {vocab_size}")
    key = (max_states, max_classes, vocab_size)
    if key not in self._tables:  # uploaded once per shape, not every decode
      self._tables[key] = self._padded(*key)
    return self._tables[key]

  def _padded(self, max_states: int, max_classes: int, vocab_size: int) -> StopTables:
    next_state = np.zeros((max_states, max_classes), np.int32)
    stop_hit = np.zeros((max_states, max_classes), bool)
    next_state[:self.num_states, :self.num_classes] = self.next_state
    stop_hit[:self.num_states, :self.num_classes] = self.stop_hit
    token_class = np.zeros(vocab_size, np.int32)
    token_class[:self.vocab_size] = self.token_class
    return StopTables(token_class=jnp.asarray(token_class),
                      next_state=jnp.asarray(next_state), stop_hit=jnp.asarray(stop_hit))


def _aho_corasick(patterns: Sequence[Sequence[int]], alphabet: int
                  ) -> tuple[np.ndarray, np.ndarray]:
  """(delta [S, alphabet], terminal [S]) of the automaton that finds any of
  `patterns` ending at the current symbol; state 0 is the start."""
  children = [{}]
  ends = [False]
  for pattern in patterns:
    node = 0
    for symbol in pattern:
      if symbol not in children[node]:
        children.append({})
        ends.append(False)
        children[node][symbol] = len(children) - 1
      node = children[node][symbol]
    ends[node] = True
  delta = np.zeros((len(children), alphabet), np.int64)
  terminal = np.asarray(ends)
  fail = [0] * len(children)
  queue = collections.deque()
  for symbol, child in children[0].items():
    delta[0, symbol] = child
    queue.append(child)
  while queue:  # breadth first: a node's failure state is done before it
    node = queue.popleft()
    terminal[node] |= terminal[fail[node]]
    delta[node] = delta[fail[node]]
    for symbol, child in children[node].items():
      fail[child] = delta[fail[node], symbol]
      delta[node, symbol] = child
      queue.append(child)
  return delta, terminal


# GPT-2's byte <-> printable-unicode map, which byte-level BPE vocabularies use.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1)]
_UNICODE_TO_BYTE = {chr(b): b for b in _PRINTABLE}
_UNICODE_TO_BYTE.update({chr(256 + i): b for i, b in enumerate(
    b for b in range(256) if b not in set(_PRINTABLE))})


def token_bytes(tokenizer) -> list[bytes | None]:
  """Per token id of a HF tokenizer, the bytes it spells (None: special).

  Byte-level BPE pieces map back through GPT-2's byte table (so a piece
  that is half a UTF-8 character is its raw byte); added non-special tokens
  (e.g. tool tags) spell their content; SentencePiece pieces spell their
  text with "▁" as a space and `<0xNN>` as that byte.
  """
  added = tokenizer.added_tokens_decoder  # id -> AddedToken
  size = max(len(tokenizer), max(added, default=-1) + 1)
  pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
  regular = [p for i, p in enumerate(pieces) if i not in added and p is not None]
  byte_level = all(c in _UNICODE_TO_BYTE for p in regular for c in p)
  out = []
  for i, piece in enumerate(pieces):
    if i in added:
      out.append(None if added[i].special else added[i].content.encode("utf-8"))
    elif piece is None:
      out.append(None)
    elif byte_level:
      out.append(bytes(_UNICODE_TO_BYTE[c] for c in piece))
    elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
      out.append(bytes([int(piece[3:5], 16)]))
    else:
      out.append(piece.replace("▁", " ").encode("utf-8"))
  return out
