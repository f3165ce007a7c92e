"""The slot scheduler: many episodes at once on the sampler's slots.

The loop (plain Python; only the sampler is jitted):

  admit     waiting episodes take free slots; their first env call (a
            reset) goes to the thread pool
  collect   finished env calls move their episodes on (`Episode.receive`)
  feed      one `prefill` for the episodes whose pending tokens start their
            slot, one `extend` for the others
  act       one batched `decode` for the episodes waiting for an action
            (at most `max_decode_batch`, longest-waiting first); each action
            goes to its own environment in the thread pool

Environment calls run concurrently in threads while the sampler keeps
decoding for the episodes whose observations are back, so a slow tool does
not idle the accelerator; `lockstep` waits for every call instead, so runs
are bit-reproducible. Every call goes through `env_calls.EnvCaller`: one
past its deadline (`env_deadline_s`, or the environment's own
`deadline_s`) ends its episode as "env_timeout", an exception or a result
outside the contract as "env_error" (its text in `metadata["env_error"]`);
the other episodes go on, and the engine stays usable. An isolated
run (`set_aside`) gets the slots an idle scheduler would have, and hands
them back with their caches and the random stream as they were.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import itertools
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from agentrl_jax import env_calls
from agentrl_jax.rollout.config import RolloutConfig
from agentrl_jax.rollout.episode import Action, EnvCall, Episode, Feed
from agentrl_jax.rollout.stats import RunStats
from agentrl_jax.sampling import Sampler, StopMatcher


class SlotScheduler:
  """Admits episodes to slots, batches their decodes, runs their env calls."""

  def __init__(self, sampler: Sampler | None, config: RolloutConfig,
               stops: StopMatcher, seed: int):
    self.sampler, self.config, self.stops = sampler, config, stops
    self.state = sampler.init_state(seed) if sampler is not None else None
    self.free = list(range(sampler.num_slots)) if sampler is not None else []
    self.calls = env_calls.EnvCaller(config.env_workers)
    self._ticks = itertools.count()  # across calls: carried episodes keep their place
    # (tokens, SlotSnapshot): the prompt prefix shared in this `run` call.
    self._prefix: tuple[tuple[int, ...], Any] | None = None

  def reseed(self, seed: int | None) -> None:
    """Restarts the sampler's random stream (None: it goes on)."""
    if seed is not None and self.state is not None:
      self.state = self.state.replace(rng=jax.random.key(seed))

  def run(self, episodes: list[Episode], stats: RunStats, *, version: int | None,
          temperature: float, expert: bool = False,
          token_budget: int | None = None,
          on_finished: Callable[[Episode], None] | None = None) -> list[Episode]:
    """Runs `episodes` (waiting ones and ones holding slots) until they all
    finish, or, past `token_budget` generated tokens, until the env calls in
    flight are back. Expert episodes act without slots. `on_finished` sees
    each finished episode before its slot is freed. Returns them all."""
    # A prefix kept by an earlier call may hold other weights' keys, and
    # which one a prompt reuses must not depend on earlier calls: a resumed
    # run repeats the calls after its checkpoint, bit for bit.
    self._prefix = None
    waiting = collections.deque(ep for ep in episodes if ep.slot is None)
    running = [ep for ep in episodes if ep.slot is not None]
    in_flight: dict[cf.Future, Episode] = {}
    generated, budget_spent = 0, False
    while True:
      submitted_in = next(self._ticks)
      while waiting and (expert or self.free) and not budget_spent:
        ep = waiting.popleft()
        ep.submitted_in = submitted_in
        ep.slot = -1 if expert else self.free.pop()
        running.append(ep)
        in_flight[self._submit(ep, ep.start())] = ep
      t0 = time.perf_counter()
      done = (cf.wait(in_flight)[0] if budget_spent  # no more decodes: finish the calls
              else self._gather(in_flight, len(_ready(running))))
      stats.env_wait += time.perf_counter() - t0
      for future in [f for f in in_flight if f in done]:  # submission order: deterministic
        ep = in_flight.pop(future)
        ep.receive(future.result())
        ep.queued_at = next(self._ticks)
      for ep in [ep for ep in running if ep.done and ep.slot is not None]:
        if on_finished is not None:
          on_finished(ep)
        self._release(ep)
      if budget_spent:
        return running + list(waiting)
      ready = _ready(running)
      if not ready:
        if not in_flight and not waiting:
          return running
        if not in_flight and not (expert or self.free):
          raise RuntimeError("episodes wait for a sampler slot but none is free or "
                             "in use: an earlier call failed mid-rollout; make a new "
                             "RolloutEngine")
        continue
      ready = ready[:self.config.max_decode_batch]
      t0 = time.perf_counter()
      actions = ([ep.expert_action() for ep in ready] if expert
                 else self._decode(ready, stats, temperature))
      stats.generation += time.perf_counter() - t0
      submitted_in = next(self._ticks)
      for ep, action in zip(ready, actions):
        ep.submitted_in = submitted_in
        generated += len(action.token_ids)
        in_flight[self._submit(ep, ep.act(action, version))] = ep
      budget_spent = token_budget is not None and generated >= token_budget

  @contextlib.contextmanager
  def set_aside(self, carried: list[Episode], needed: int, expert: bool) -> Iterator[None]:
    """Frees slots for an isolated run of `needed` episodes, and puts back
    the `carried` episodes' slots afterwards.

    Carried episodes keep their slots between calls; the ones the isolated
    run needs beyond the free slots are snapshotted (`Sampler.snapshot`) and
    freed, then forked back into the same slots, with the free list and the
    sampler's random stream as they were: the carried episodes go on
    bit-identically, and the isolated run sees the slots an engine carrying
    nothing would. Their next-token logits need no copy: a carried episode
    always has tokens pending (an observation, or its prompt), whose feed
    recomputes them.
    """
    free, snapshots, rng = list(self.free), {}, None
    if self.sampler is not None and not expert:
      held = [ep for ep in carried if ep.slot is not None and ep.slot >= 0]
      for ep in held[:max(needed - len(self.free), 0)]:
        if not ep.pending.prefill:  # (a prefill restarts its slot anyway)
          snapshots[ep.slot] = self.sampler.snapshot(self.state, ep.slot, ep.cached_tokens)
        self.free.append(ep.slot)
      rng = jnp.copy(self.state.rng)  # a copy: the decodes donate the state's
    try:
      yield
    finally:
      self.free = free
      for slot, snapshot in snapshots.items():
        self.state = self.sampler.fork(self.state, slot, snapshot, snapshot.length)
      if rng is not None:
        self.state = self.state.replace(rng=rng)

  def _gather(self, in_flight: dict[cf.Future, Episode], num_ready: int) -> set:
    """The env calls to collect before the next decode.

    Blocks for the first call only when no episode is ready. Calls submitted
    together (one decode's actions, one round of resets) usually take about
    as long, so once one is back the rest of its cohort gets up to
    `batch_wait_s` to join, while the decode batch has room; slow calls
    nobody has heard from are not waited for. Lockstep waits for them all.
    """
    if self.config.lockstep:
      return cf.wait(in_flight)[0]
    room = self.config.max_decode_batch or len(in_flight) + num_ready
    done = cf.wait(in_flight, timeout=None if num_ready == 0 else 0,
                   return_when=cf.FIRST_COMPLETED)[0]
    cohorts = {in_flight[f].submitted_in for f in done}
    siblings = {f for f, ep in in_flight.items() if ep.submitted_in in cohorts} - done
    deadline = time.perf_counter() + self.config.batch_wait_s
    while siblings and num_ready + len(done) < room:
      arrived, siblings = cf.wait(siblings, timeout=max(deadline - time.perf_counter(), 0),
                                  return_when=cf.FIRST_COMPLETED)
      if not arrived:
        break
      done |= arrived
    return done

  def _decode(self, ready: list[Episode], stats: RunStats,
              temperature: float) -> list[Action]:
    """Feeds the episodes' pending tokens, then samples their actions in one call."""
    sampler, cfg = self.sampler, self.config
    self._share_prefix([ep for ep in ready if ep.pending.prefill], stats)
    for prefill in (True, False):
      feed = [ep for ep in ready if ep.pending.prefill == prefill]
      for ep in feed:
        if ep.pending.fork is not None:
          self.state = sampler.fork(self.state, ep.slot, *ep.pending.fork)
      if feed:
        call = sampler.prefill if prefill else sampler.extend
        self.state = call(self.state, [ep.slot for ep in feed],
                          [ep.pending.tokens for ep in feed])
        stats.fed_tokens += sum(len(ep.pending.tokens) for ep in feed)
      for ep in feed:
        ep.cached_tokens = ep.length
    room = [min(cfg.max_action_tokens, sampler.cache_length - ep.length) for ep in ready]
    self.state, actions = sampler.decode(
        self.state, [ep.slot for ep in ready], stops=self.stops,
        max_new_tokens=room, temperature=temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    stats.decode_calls += 1
    stats.occupancy += len(ready) / sampler.num_slots
    out = []
    for ep in ready:
      action = actions[ep.slot]
      ep.cached_tokens += len(action.tokens)
      stats.generated_tokens += len(action.tokens)
      out.append(Action(action.tokens, action.raw_logprobs, action.stop_reason,
                        action.sampled_logprobs))
    return out

  def _share_prefix(self, feed: list[Episode], stats: RunStats) -> None:
    """Turns the prefills of `feed` that begin with the shared prompt prefix
    into a copy of its cached keys and values (`Sampler.fork`) plus an
    extend by the rest. The prefix kept (for the rest of the `run` call) is
    reused while every prompt fed begins with it; otherwise, where two or
    more prompts agree on at least `min_shared_prefix` leading tokens, their
    common prefix is computed once in the first one's slot and kept
    instead. At least one token of each prompt is left to extend: it gives
    the next-token logits."""
    if not feed or not self.config.min_shared_prefix:
      return
    lists = [ep.pending.tokens for ep in feed]
    starts = lambda t: (self._prefix is not None and len(t) > len(self._prefix[0])
                        and tuple(t[:len(self._prefix[0])]) == self._prefix[0])
    if not all(map(starts, lists)) and len(lists) > 1:
      n = min(_common_prefix(lists), min(map(len, lists)) - 1)
      if n >= self.config.min_shared_prefix:
        slot, prefix = feed[0].slot, tuple(lists[0][:n])
        self.state = self.sampler.prefill(self.state, [slot], [prefix])
        stats.fed_tokens += n
        self._prefix = (prefix, self.sampler.snapshot(self.state, slot, n))
    for ep in feed:
      if starts(ep.pending.tokens):
        n = len(self._prefix[0])
        ep.pending = Feed(ep.pending.tokens[n:], prefill=False, fork=(self._prefix[1], n))

  def _submit(self, ep: Episode, call: EnvCall) -> cf.Future:
    """Submits an env call of `ep` under its deadline."""
    deadline = getattr(ep.env, "deadline_s", None) or self.config.env_deadline_s
    return self.calls.submit(_timed, ep, call.fn, *call.args, check=call.check,
                             deadline_s=None if deadline is None else deadline * call.count)

  def _release(self, ep: Episode) -> None:
    if self.sampler is not None and ep.slot >= 0:
      self.free.append(ep.slot)
    ep.slot = None
    self._submit(ep, EnvCall(ep.env.close))  # not waited for; a hung close is abandoned


def _common_prefix(lists: list[list[int]]) -> int:
  """How many leading tokens every list shares."""
  n = min(map(len, lists))
  for i in range(n):
    if any(t[i] != lists[0][i] for t in lists):
      return i
  return n


def _ready(running: list[Episode]) -> list[Episode]:
  """Episodes waiting for an action, longest-waiting first (cohorts stay whole)."""
  return sorted((ep for ep in running if not ep.done and ep.pending is not None),
                key=lambda ep: ep.queued_at)


def _timed(ep: Episode, fn, *args):
  """Runs an env call (on a worker), adding its seconds to the episode's."""
  t0 = time.perf_counter()
  try:
    return fn(*args)
  finally:
    ep.steps.env_time += time.perf_counter() - t0
