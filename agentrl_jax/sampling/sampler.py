"""Jitted KV-cache sampler that generates turn by turn.

The sampler holds a fixed number of *slots*, each one live episode with its
own region of the KV cache. Per turn:

  state = sampler.prefill(state, slots, prompts)        # new episodes
  state, actions = sampler.decode(state, slots, ...)     # until stop/budget
  state = sampler.extend(state, slots, observations)     # KV only for new tokens

`extend` computes keys/values only for the appended tokens and attends to
the prefix already in the cache, so a T-turn episode costs O(total tokens),
not O(T x context) as re-prefilling the conversation every turn would.
A slot is reused for a new episode by prefilling it again (or `release`):
shapes never change, so nothing recompiles (continuous batching at turn
granularity).

Static shapes: the number of slots B, cache length S and decode buffer T are
fixed at construction; prompt/extension lengths are padded to
`length_buckets`, and the slots touched by one call are gathered into a
sub-batch padded to a power of two (so decoding 3 live episodes costs a
4-row decode, not a B-row one). A decode attends over the first W cache
positions only, W the smallest of `attention_windows` (default S/4, S/2, S)
that holds the slots' contexts plus their new tokens: each decode step
streams the keys/values it attends over, so short contexts in a long cache
decode faster (`benchmarks/sampler.py`). At most (log2 B + 1) x
len(length_buckets) extend and (log2 B + 1) x len(attention_windows) decode
programs are ever compiled; `compile_counts` counts traces per entry point.

Forking (`snapshot`, `fork`): a device copy of a slot's cached prefix can
restart another slot later at any length it holds, with no compute: a
continuation from an intermediate state of an episode costs only its own
new tokens (branching, `RolloutEngine.branch`). A snapshot keeps the
smallest attention window that holds the slot's tokens.

Log-probs: `decode` reports, per sampled token, `raw_logprobs` (the policy
the trainer trains: logits / `policy_temperature`, 1 by default, no
filtering; what the train step recomputes, and what it uses as old
log-probs) and `sampled_logprobs` (under the temperature/top-k/top-p
distribution the token was actually drawn from: the behaviour policy of
the train step's importance weights). The rollout records both.

Under a `mesh` the shardings are fixed at the jit boundary: parameters by
`sharding.PARTITION_RULES`, slots (cache, lengths, logits) over ("data",
"fsdp") and the cache's kv heads over "tensor" where they divide.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Sequence

import flax.struct
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax import distributed, sharding
from agentrl_jax.models.decoder import Decoder, KVCache, compute_params
from agentrl_jax.sampling import stops as stops_lib
from agentrl_jax.sampling.processing import SamplingParams, sample
from agentrl_jax.trajectory import bucket_length

STOP_NONE, STOP_SEQUENCE, STOP_BUDGET, STOP_CACHE_FULL = 0, 1, 2, 3


@flax.struct.dataclass
class SamplerState:
  cache: KVCache  # per layer keys [B, KV, D, S], values [B, KV, S, D]
  lengths: jax.Array  # [B] int32, tokens held in the cache per slot
  next_logits: jax.Array  # [B, V] float32, logits for each slot's next token
  rng: jax.Array  # PRNG key


@flax.struct.dataclass
class SlotSnapshot:
  """A device copy of one slot's first `length` cached tokens (`Sampler.snapshot`)."""

  k: tuple[jax.Array, ...]  # per layer [KV, D, W], W the window that holds `length`
  v: tuple[jax.Array, ...]  # per layer [KV, W, D]
  length: int = flax.struct.field(pytree_node=False)  # tokens it holds


@flax.struct.dataclass
class _DecodeBuffers:
  tokens: jax.Array  # [B, T] int32
  raw_logprobs: jax.Array  # [B, T] float32
  sampled_logprobs: jax.Array  # [B, T] float32
  num_tokens: jax.Array  # [B] int32
  stop_reason: jax.Array  # [B] int32, STOP_*


@dataclasses.dataclass(frozen=True)
class Action:
  """What one slot generated in one `decode` call."""

  tokens: list[int]  # including the token that completed a stop
  raw_logprobs: list[float]  # log pi(token) at policy_temperature: the trainer's
  sampled_logprobs: list[float]  # under the distribution sampled from
  stop_reason: int  # STOP_SEQUENCE, STOP_BUDGET or STOP_CACHE_FULL


class Sampler:
  """Prefill / decode / extend over a fixed set of slots (see module doc).

  attention_windows: cache prefixes a decode may attend over (must include
    cache_length; None: S/4, S/2, S); fewer windows, fewer programs.
  mesh: None (one device), or a `sharding.make_mesh` mesh to place the
    parameters, the cache and the per-slot state on.
  max_stop_states, max_stop_classes: the stop automaton's fixed table shape
    (8 tool tags over the 151,665-token Qwen2.5 vocabulary: 62 states and
    124 classes).
  policy_temperature: the temperature of the policy `raw_logprobs` are
    reported under: the train step's (`LossConfig.temperature`).
  """

  def __init__(self, model: Decoder, *, num_slots: int, cache_length: int,
               max_decode_length: int = 256,
               length_buckets: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024),
               max_stop_states: int = 128, max_stop_classes: int = 256,
               attention_windows: Sequence[int] | None = None,
               mesh: jax.sharding.Mesh | None = None, policy_temperature: float = 1.0):
    if not policy_temperature > 0:
      raise ValueError(f"policy_temperature must be > 0, got {policy_temperature}")
    self._policy_temperature = float(policy_temperature)
    self.cfg = model.cfg
    self.graphdef, params = nnx.split(model)
    params = compute_params(params, self.cfg.dtype)  # the sampler's own copy
    self.num_slots, self.cache_length = num_slots, cache_length
    self.max_decode_length = max_decode_length
    self.length_buckets = tuple(sorted(length_buckets))
    windows = (sorted({cache_length, cache_length // 2, cache_length // 4} - {0})
               if attention_windows is None else sorted(set(attention_windows)))
    if windows[-1] != cache_length or windows[0] < 1:
      raise ValueError(f"attention_windows must lie in [1, cache_length] and include "
                       f"cache_length {cache_length}, got {windows}")
    self.attention_windows = tuple(windows)
    # The stop automaton's tables are padded to these (sampling/stops.py):
    # any stop set that fits runs in the same compiled decode.
    self.max_stop_states, self.max_stop_classes = max_stop_states, max_stop_classes
    self.compile_counts: collections.Counter = collections.Counter()
    if mesh is None:
      self.params, self._param_sharding, self._init_jit = params, None, None
      extend_shardings = decode_shardings = fork_shardings = {}
    else:
      ps = self._param_sharding = sharding.param_shardings(params, mesh)
      abstract = jax.eval_shape(self._new_state, 0)
      ss = abstract.replace(
          cache=sharding.cache_sharding(abstract.cache, mesh),
          lengths=sharding.rows_sharding(abstract.lengths, mesh),
          next_logits=sharding.rows_sharding(abstract.next_logits, mesh),
          rng=sharding.replicated(mesh))
      rep = sharding.replicated(mesh)
      self.params = sharding.shard(params, ps)
      extend_shardings = dict(in_shardings=(ps, ss) + (rep,) * 4, out_shardings=ss)
      decode_shardings = dict(in_shardings=(ps, ss) + (rep,) * 4, out_shardings=(ss, rep))
      fork_shardings = dict(out_shardings=ss)
      # Built in its shards: the whole cache never sits on one device.
      self._init_jit = jax.jit(self._new_state, out_shardings=ss)
    # The state (and its cache) is donated: XLA updates it in place.
    self._extend_jit = jax.jit(self._extend_impl, donate_argnums=(1,), **extend_shardings)
    self._decode_jit = jax.jit(self._decode_impl, donate_argnums=(1,),
                               static_argnums=(6,), **decode_shardings)
    self._snapshot_jit = jax.jit(_snapshot_impl, static_argnums=(2,))
    self._fork_jit = jax.jit(_fork_impl, donate_argnums=(0,), **fork_shardings)

  @property
  def policy_temperature(self) -> float:
    """Read-only: the compiled decode programs keep the value they were built with."""
    return self._policy_temperature

  def update_params(self, model_or_params) -> None:
    """Weight sync: the next call samples from these parameters
    (`prepare_params`'s copy of them)."""
    self.params = self.prepare_params(model_or_params)

  def drop_params(self) -> None:
    """Frees the sampler's weights until the next `update_params`: a
    synchronous trainer replaces them after its step anyway, and holding
    them through the step adds their bytes to its peak."""
    self.params = None

  def _weights(self):
    if self.params is None:
      raise RuntimeError("the sampler's weights were dropped (drop_params): "
                         "give it weights with update_params first")
    return self.params

  def prepare_params(self, model_or_params):
    """The sampler's copy of `model_or_params`, to assign to `params` now or
    later (an asynchronous trainer's rollouts sample with older weights).

    Never through the host: a device-side copy in the compute dtype
    (`models.compute_params`: float32 masters sample as their bf16 copy,
    exactly what the trainer's forward computes), so a train step that
    donates its own parameters cannot delete the sampler's; under a mesh, a
    device-to-device reshard when the given parameters are laid out
    otherwise (a trainer on another mesh or other devices), else a copy in
    place. Parameters that span several processes (a multi-host trainer)
    are resharded onto this process's mesh (`distributed.to_local`; every
    process calls it).
    """
    if isinstance(model_or_params, nnx.Module):
      _, model_or_params = nnx.split(model_or_params)
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable
           for x in jax.tree.leaves(model_or_params)):
      if self._param_sharding is None:
        raise ValueError("parameters spanning several processes need a sampler on a "
                         "local mesh (distributed.local_mesh)")
      local = distributed.to_local(model_or_params, self._param_sharding)
      return compute_params(local, self.cfg.dtype)
    if self._param_sharding is None:
      return compute_params(model_or_params, self.cfg.dtype)
    # A fresh copy where the parameters are, then moved (or kept) in place.
    return jax.device_put(compute_params(model_or_params, self.cfg.dtype),
                          self._param_sharding)

  def init_state(self, seed: int = 0) -> SamplerState:
    if self._init_jit is None:
      return self._new_state(seed)
    return self._init_jit(seed)

  def _new_state(self, seed) -> SamplerState:
    b = self.num_slots
    return SamplerState(
        cache=KVCache.zeros(self.cfg, b, self.cache_length),
        lengths=jnp.zeros(b, jnp.int32),
        next_logits=jnp.zeros((b, self.cfg.vocab_size), jnp.float32),
        rng=jax.random.key(seed))

  def warmup(self, state: SamplerState) -> SamplerState:
    """Compiles every extend and decode shape now rather than mid-run.

    Runs the extend of each (row bucket, length bucket) and the decode of
    each (row bucket, attention window) once on dummy tokens and releases
    all slots afterwards: call it on a fresh state.
    """
    rows = sorted({self._row_bucket(n) for n in range(1, self.num_slots + 1)})
    for r in rows:
      slots = list(range(r))
      for length in self.length_buckets:
        state = self.prefill(state, slots, [[0] * min(length, self.cache_length - 1)] * r)
      state = self.prefill(state, slots, [[0]] * r)  # a context that fits any window
      for window in self.attention_windows:
        state, _ = self._decode_call(state, slots, 1, _id_stops((), self.cfg.vocab_size),
                                       1.0, 0, 1.0, window)
    return self.release(state, list(range(self.num_slots)))

  # -- Host entry points -----------------------------------------------------------

  def prefill(self, state: SamplerState, slots: Sequence[int],
              token_lists: Sequence[Sequence[int]]) -> SamplerState:
    """Starts new episodes: the slots' caches restart with these prompts."""
    return self.extend(state, slots, token_lists, reset=True)

  def release(self, state: SamplerState, slots: Sequence[int]) -> SamplerState:
    """Marks slots empty (their next prefill starts from position 0)."""
    return state.replace(lengths=state.lengths.at[jnp.asarray(slots)].set(0))

  def extend(self, state: SamplerState, slots: Sequence[int],
             token_lists: Sequence[Sequence[int]], *,
             reset: bool = False) -> SamplerState:
    """Appends tokens to live slots, computing KV only for the new tokens.

    Lists longer than the largest length bucket are fed in chunks.
    """
    slots = [int(s) for s in slots]
    lists = [np.asarray(t, np.int64).reshape(-1) for t in token_lists]
    self._check_slots(slots, len(lists))
    for s, toks in zip(slots, lists):
      if toks.size == 0:
        raise ValueError(f"slot {s}: nothing to extend with (empty token list)")
      if toks.min() < 0 or toks.max() >= self.cfg.vocab_size:
        raise ValueError(f"slot {s}: token ids must be in [0, {self.cfg.vocab_size})")
    held = np.zeros(len(slots), np.int64) if reset else np.asarray(state.lengths)[slots]
    for s, h, toks in zip(slots, held, lists):
      if h + toks.size > self.cache_length:
        raise ValueError(
            f"slot {s}: {h} + {toks.size} tokens exceed the cache length "
            f"{self.cache_length}")
    chunk = self.length_buckets[-1]
    for start in range(0, max(t.size for t in lists), chunk):
      part = [(s, t[start:start + chunk]) for s, t in zip(slots, lists)
              if t.size > start]
      rows = self._row_bucket(len(part))
      width = bucket_length(max(t.size for _, t in part), self.length_buckets)
      slot_idx = np.full(rows, self.num_slots, np.int32)  # padding rows: dropped
      tokens = np.zeros((rows, width), np.int32)
      n_new = np.zeros(rows, np.int32)
      for r, (s, t) in enumerate(part):
        slot_idx[r], tokens[r, :t.size], n_new[r] = s, t, t.size
      state = self._extend_jit(self._weights(), state, slot_idx, tokens, n_new,
                               reset and start == 0)
    return state

  def snapshot(self, state: SamplerState, slot: int, length: int) -> SlotSnapshot:
    """A device copy of the first `length` tokens cached in `slot` (at most
    what it holds; the host knows that), for `fork`. It costs the smallest
    attention window that holds them, one slot's worth at most."""
    self._check_slots([slot], 1)
    if not 1 <= length <= self.cache_length:
      raise ValueError(f"snapshot length {length} outside [1, {self.cache_length}]")
    window = next(w for w in self.attention_windows if w >= length)
    k, v = self._snapshot_jit(state.cache, np.int32(slot), window)
    return SlotSnapshot(k=k, v=v, length=length)

  def fork(self, state: SamplerState, slot: int, snapshot: SlotSnapshot,
           length: int) -> SamplerState:
    """`slot` restarts from the first `length` tokens of `snapshot` (a copy,
    no compute). Its next-token logits are not set: `extend` it by at least
    one token (e.g. the prefix's last, cut off `length`) before decoding."""
    self._check_slots([slot], 1)
    if not 0 <= length <= snapshot.length:
      raise ValueError(f"fork length {length} outside the snapshot's [0, {snapshot.length}]")
    return self._fork_jit(state, np.int32(slot), snapshot.k, snapshot.v, np.int32(length))

  def decode(self, state: SamplerState, slots: Sequence[int], *,
             stops: stops_lib.StopMatcher | None = None,
             stop_sequences: Sequence[Sequence[int]] = (),
             max_new_tokens: int | Sequence[int] | None = None,
             temperature=1.0, top_k=0, top_p=1.0
             ) -> tuple[SamplerState, dict[int, Action]]:
    """Samples for `slots` until each hits a stop, its budget or the
    cache end. The other slots are untouched.

    Args:
      stops: stop strings matched on the text the tokens spell, and stop ids
        (`StopMatcher.from_strings`, e.g. `ChatFormat.stop_matcher`); the
        token that completes a stop is the action's last.
      stop_sequences: or stops as token-id sequences (ignored with `stops`).
      max_new_tokens: per-slot (or shared) budget, at most max_decode_length.
      temperature, top_k, top_p: scalars or per-slot sequences (0 temperature
        = greedy); arrays inside the jit, so changing them never recompiles.
    Returns:
      (new state, {slot: Action}).
    """
    slots = [int(s) for s in slots]
    self._check_slots(slots, len(slots))
    if not slots:
      return state, {}
    budget = np.broadcast_to(np.asarray(
        self.max_decode_length if max_new_tokens is None else max_new_tokens,
        np.int64), (len(slots),))
    if budget.max() > self.max_decode_length:
      raise ValueError(f"max_new_tokens {budget.max()} > max_decode_length "
                       f"{self.max_decode_length}")
    # Attend over the smallest window that holds every slot's context and
    # its new tokens: decoding streams the window's keys each step.
    need = int(np.max(np.asarray(state.lengths)[slots] + budget))
    window = next((w for w in self.attention_windows if w >= need), self.cache_length)
    if stops is None:
      stops = _id_stops(tuple(tuple(int(t) for t in seq) for seq in stop_sequences),
                        self.cfg.vocab_size)
    return self._decode_call(state, slots, budget, stops, temperature, top_k, top_p,
                             window)

  def _decode_call(self, state, slots, budget, stops, temperature, top_k, top_p, window):
    rows = self._row_bucket(len(slots))

    def per_row(x, dtype, pad=0):
      out = np.full(rows, pad, dtype)
      out[:len(slots)] = np.broadcast_to(np.asarray(x, dtype), (len(slots),))
      return out

    budget = per_row(budget, np.int32)
    slot_idx = per_row(slots, np.int32, pad=self.num_slots)  # padding: dropped
    sampling = SamplingParams(
        temperature=per_row(temperature, np.float32),
        top_k=per_row(top_k, np.int32), top_p=per_row(top_p, np.float32, pad=1.0))
    tables = stops.tables(self.max_stop_states, self.max_stop_classes, self.cfg.vocab_size)
    state, out = self._decode_jit(self._weights(), state, slot_idx, budget, tables, sampling,
                                  window)
    out = jax.device_get(out)
    actions = {}
    for r, s in enumerate(slots):
      n = int(out.num_tokens[r])
      actions[s] = Action(
          tokens=out.tokens[r, :n].tolist(),
          raw_logprobs=out.raw_logprobs[r, :n].tolist(),
          sampled_logprobs=out.sampled_logprobs[r, :n].tolist(),
          stop_reason=int(out.stop_reason[r]))
    return state, actions

  def _row_bucket(self, n: int) -> int:
    """Rows for a call touching n slots: the next power of two (<= B)."""
    return min(1 << (n - 1).bit_length(), self.num_slots)

  def _check_slots(self, slots, n):
    if len(slots) != n:
      raise ValueError(f"{len(slots)} slots but {n} token lists")
    if len(set(slots)) != len(slots) or not all(0 <= s < self.num_slots for s in slots):
      raise ValueError(f"slots must be distinct and in [0, {self.num_slots}), got {slots}")

  # -- Jitted bodies ----------------------------------------------------------------

  def _extend_impl(self, params, state, slot_idx, tokens, n_new, reset):
    self.compile_counts["extend"] += 1  # runs only while tracing
    model = nnx.merge(self.graphdef, params)
    s_len = self.cache_length
    rows = jnp.minimum(slot_idx, self.num_slots - 1)
    start = jnp.where(reset, 0, state.lengths[rows])
    j = jnp.arange(tokens.shape[1])
    # Padding tokens are parked beyond the cache: their writes are dropped.
    positions = jnp.where(j[None] < n_new[:, None], start[:, None] + j[None], s_len + j[None])
    sub = KVCache(k=tuple(k[rows] for k in state.cache.k),
                  v=tuple(v[rows] for v in state.cache.v))
    hidden, sub = model.hidden_states(tokens, positions, cache=sub)
    last = jnp.take_along_axis(hidden, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = model.logits(last).astype(jnp.float32)
    put = lambda full, part: full.at[slot_idx].set(part, mode="drop")
    cache = KVCache(k=tuple(map(put, state.cache.k, sub.k)),
                    v=tuple(map(put, state.cache.v, sub.v)))
    return state.replace(
        cache=cache, lengths=put(state.lengths, start + n_new),
        next_logits=put(state.next_logits, logits))

  def _decode_impl(self, params, state, slot_idx, budget, stop_tables, sampling, window):
    self.compile_counts["decode"] += 1  # runs only while tracing
    model = nnx.merge(self.graphdef, params)
    t_max, s_len = self.max_decode_length, self.cache_length
    # Decode on the requested slots only (gathered into a power-of-two
    # sub-batch) and their first `window` cache positions (which hold every
    # context and the new tokens), so the cost follows the live episodes,
    # not the slot count and cache length.
    rows = jnp.minimum(slot_idx, self.num_slots - 1)
    b = slot_idx.shape[0]
    sub = state.replace(
        cache=KVCache(k=tuple(k[rows, :, :, :window] for k in state.cache.k),
                      v=tuple(v[rows, :, :window] for v in state.cache.v)),
        lengths=state.lengths[rows], next_logits=state.next_logits[rows])
    live = (slot_idx < self.num_slots) & (budget > 0) & (sub.lengths < s_len)
    buffers = _DecodeBuffers(
        tokens=jnp.zeros((b, t_max), jnp.int32),
        raw_logprobs=jnp.zeros((b, t_max), jnp.float32),
        sampled_logprobs=jnp.zeros((b, t_max), jnp.float32),
        num_tokens=jnp.zeros(b, jnp.int32),
        stop_reason=jnp.full(b, STOP_NONE, jnp.int32))
    stop_state = jnp.zeros(b, jnp.int32)  # each action matches afresh

    def cond(carry):
      step, _, _, live, _ = carry
      return (step < t_max) & jnp.any(live)

    def body(carry):
      step, sub, out, live, stop_state = carry
      rng, key = jax.random.split(sub.rng)
      token, raw, sampled = sample(key, sub.next_logits, sampling, self._policy_temperature)
      # Every live row has generated exactly `step` tokens so far.
      out = out.replace(
          tokens=out.tokens.at[:, step].set(jnp.where(live, token, 0)),
          raw_logprobs=out.raw_logprobs.at[:, step].set(jnp.where(live, raw, 0.0)),
          sampled_logprobs=out.sampled_logprobs.at[:, step].set(
              jnp.where(live, sampled, 0.0)))
      # Feed the token (stop tokens too: they are context for the next turn).
      positions = jnp.where(live, sub.lengths, s_len)[:, None]
      hidden, cache = model.hidden_states(token[:, None], positions, cache=sub.cache)
      logits = model.logits(hidden[:, 0]).astype(jnp.float32)
      lengths = sub.lengths + live
      count = out.num_tokens + live
      stop_state, hit_stop = stops_lib.advance(stop_tables, stop_state, token)
      hit_stop = live & hit_stop
      hit_budget = live & (count >= budget)
      hit_full = live & (lengths >= s_len)
      reason = jnp.where(hit_stop, STOP_SEQUENCE, jnp.where(
          hit_budget, STOP_BUDGET, jnp.where(hit_full, STOP_CACHE_FULL, out.stop_reason)))
      sub = sub.replace(
          cache=cache, lengths=lengths, rng=rng,
          next_logits=jnp.where(live[:, None], logits, sub.next_logits))
      out = out.replace(num_tokens=count, stop_reason=reason)
      return step + 1, sub, out, live & ~(hit_stop | hit_budget | hit_full), stop_state

    _, sub, out, _, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(0), sub, buffers, live, stop_state))
    put = lambda full, part: full.at[slot_idx].set(part, mode="drop")
    put_k = lambda full, part: full.at[slot_idx, :, :, :window].set(part, mode="drop")
    put_v = lambda full, part: full.at[slot_idx, :, :window].set(part, mode="drop")
    state = state.replace(
        cache=KVCache(k=tuple(map(put_k, state.cache.k, sub.cache.k)),
                      v=tuple(map(put_v, state.cache.v, sub.cache.v))),
        lengths=put(state.lengths, sub.lengths),
        next_logits=put(state.next_logits, sub.next_logits), rng=sub.rng)
    return state, out


def _snapshot_impl(cache: KVCache, slot, window: int):
  return (tuple(k[slot, :, :, :window] for k in cache.k),
          tuple(v[slot, :, :window] for v in cache.v))


def _fork_impl(state: SamplerState, slot, k, v, length) -> SamplerState:
  put = lambda full, part: jax.lax.dynamic_update_slice(
      full, part[None].astype(full.dtype), (slot, 0, 0, 0))
  return state.replace(
      cache=KVCache(k=tuple(map(put, state.cache.k, k)), v=tuple(map(put, state.cache.v, v))),
      lengths=state.lengths.at[slot].set(length))


@functools.lru_cache(maxsize=64)
def _id_stops(sequences: tuple[tuple[int, ...], ...], vocab_size: int
              ) -> stops_lib.StopMatcher:
  return stops_lib.StopMatcher.from_token_sequences(sequences, vocab_size)
