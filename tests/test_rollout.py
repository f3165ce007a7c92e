"""RolloutEngine on toy environments: ids, masks, isolation, budgets, seams."""

import collections
import dataclasses
import sys
import threading
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import losses, models
from agentrl_jax import tokenizer as T
from agentrl_jax.envs import StepResult, Task
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax.sampling import Sampler
from agentrl_jax.trajectory import Role, collate
from conftest import seam_split


class CountdownEnv:
  """Ends after task.data["steps"] steps; reward 1 per action; records all."""

  system_prompt = "Say anything."
  stop_strings = ("</done>",)
  instances = []
  lock = threading.Lock()

  def __init__(self, suffix=""):
    self.suffix, self.seen = suffix, []
    with self.lock:
      CountdownEnv.instances.append(self)

  def reset(self, task):
    self.task, self.left = task, task.data["steps"]
    self.seen.append(("reset", task.task_id))
    return f"Task {task.task_id}: go.", {"state_key": ("left", self.left)}

  def step(self, action):
    self.seen.append(("step", action))
    self.left -= 1
    if action.startswith("boom"):
      raise RuntimeError("tool crashed")
    obs = f"You said {len(action)} chars; {self.left} left{self.suffix}"
    return StepResult(obs, 1.0, self.left <= 0, False,
                      {"tool_call": True, "reward_parts": {"outcome": 1.0},
                       "state_key": ("left", self.left), "malformed": self.left % 2 == 1})

  def close(self):
    pass

  @classmethod
  def expert(cls, task):
    return lambda observation: "wer</done>"


def _assert_rescored(model, batch):
  """The trainer's teacher-forced log-probs equal the rollout's; returns the mask."""
  logits = model(jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                 jnp.asarray(batch.seq_ids))
  lp = np.asarray(losses.token_logprobs(logits, jnp.asarray(batch.tokens)))
  on = batch.loss_mask > 0
  np.testing.assert_allclose(lp[on], batch.old_logprobs[on], atol=1e-4)
  return on


def _tasks(n, steps=(1, 2, 3, 4)):
  return [Task(f"t{i}", f"task {i}", {"steps": steps[i % len(steps)]}) for i in range(n)]


@pytest.fixture(scope="module")
def tok():
  return T.load_tokenizer()


@pytest.fixture(scope="module")
def model():
  return models.Decoder(models.tiny_config("llama"), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def sampler(model):
  return Sampler(model, num_slots=4, cache_length=256, max_decode_length=16,
                 length_buckets=(16, 32, 64))


def test_rollout_ids_logprobs_masks_and_isolation(tok, model, sampler):
  CountdownEnv.instances.clear()
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=3, max_action_tokens=12))
  result = engine.run(_tasks(3), group_size=3)  # 9 episodes on 4 slots
  trajs = result.trajectories
  assert len(trajs) == 9
  assert [t.metadata["group_id"] for t in trajs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
  # Turn budgets: task steps 1, 2, 3 with max_turns 3: all terminate.
  assert [t.num_turns for t in trajs] == [1] * 3 + [2] * 3 + [3] * 3
  assert all(t.terminated and not t.truncated for t in trajs)
  # Re-scoring the flattened trajectories gives the rollout's log-probs.
  batch = collate(trajs, buckets=(128, 256))
  _assert_rescored(model, batch)
  # Masks cover exactly the sampled tokens: what each env received, decoded.
  envs = [e for e in CountdownEnv.instances if e.seen]
  assert len(envs) == 9, "one environment instance per episode"
  by_task = {}
  for e in envs:
    assert sum(kind == "reset" for kind, _ in e.seen) == 1
    by_task.setdefault(e.seen[0][1], []).append([a for k, a in e.seen if k == "step"])
  for t in trajs:
    actions = [tok.decode(s.token_ids) for s in t.segments if s.role == Role.ASSISTANT]
    assert actions in by_task[t.metadata["task_id"]]
    by_task[t.metadata["task_id"]].remove(actions)
  m = result.metrics
  assert m["episodes"] == 9 and m["turns_mean"] == 2.0 and m["terminated_frac"] == 1.0
  # The env calls a step malformed when it leaves an odd count: one step of
  # a 2- or 3-step episode, none of a 1-step one: 6 of the 18 turns.
  assert [t.metadata["malformed"] for t in trajs] == [0] * 3 + [1] * 6
  assert m["malformed_turn_frac"] == pytest.approx(6 / 18)
  assert 0 < m["slot_occupancy"] <= 1.0


def test_budgets_errors_and_truncation(tok, sampler):
  engine = RolloutEngine(lambda: CountdownEnv(suffix=" x" * 200), tok, T.REACT, sampler,
                         RolloutConfig(max_turns=2, max_action_tokens=8,
                                       max_observation_tokens=10))
  trajs = engine.run(_tasks(2, steps=(5,)), group_size=1).trajectories
  for t in trajs:
    assert t.truncated and not t.terminated and t.metadata["stop_reason"] == "max_turns"
    assert t.num_turns == 2
    assert all(len(s) <= 8 for s in t.segments if s.role == Role.ASSISTANT)
    obs = [tok.decode(s.token_ids) for s in t.segments if s.role == Role.OBSERVATION]
    # The second observation is the state the turn budget cut it in.
    assert len(obs) == 2 and all("...[truncated" in o for o in obs)
    assert t.segments[-1].role == Role.OBSERVATION


def test_expert_mode_and_the_bpe_seam(tok):
  """Observations end in the head of a word, the next action starts with its
  tail: re-encoding the text would merge them; the recorded ids must be the
  deltas."""
  head, tail = seam_split(tok)
  seam = T.ChatFormat(name="seam", prompt="{system}\n{task}\n",
                      observation="\nObs: {observation}", end_of_turn="", stops=())

  class SeamEnv(CountdownEnv):
    @classmethod
    def expert(cls, task):
      return lambda observation: tail + "</done>"

  engine = RolloutEngine(lambda: SeamEnv(suffix=head), tok, seam,
                         config=RolloutConfig(max_turns=4))
  trajs = engine.run(_tasks(2, steps=(3,)), group_size=2, expert=True).trajectories
  assert len(trajs) == 4
  for t in trajs:
    ids, mask = t.flatten()
    deltas = []
    for seg in t.segments:
      deltas += list(seg.token_ids)
      if seg.role == Role.ASSISTANT:
        assert list(seg.token_ids) == T.encode(tok, tail + "</done>")
        assert seg.logprobs is None
    assert list(ids) == deltas
    assert T.encode(tok, tok.decode(ids)) != list(ids), "the seam must merge"
    assert t.terminated and t.num_turns == 3


def test_an_exception_in_step_ends_the_episode_as_env_error(tok):
  class Crashy(CountdownEnv):
    @classmethod
    def expert(cls, task):
      return lambda observation: "boom</done>"

  engine = RolloutEngine(Crashy, tok, T.REACT, config=RolloutConfig(max_turns=2))
  (t,) = engine.run(_tasks(1, steps=(5,)), expert=True).trajectories
  assert t.truncated and not t.terminated and t.num_turns == 1
  assert t.metadata["stop_reason"] == "env_error"
  assert t.metadata["env_error"] == "RuntimeError: tool crashed"
  assert t.segments[-1].role == Role.ASSISTANT  # the action the env failed on
  assert t.turn_rewards == [0.0]
  t.validate()


def test_slow_tools_overlap_decoding_in_whole_cohorts(tok, model):
  """Tools that take 0.3 s: one cohort decodes while the other's tools run,
  nobody waits for calls not yet heard from, and a cohort whose calls come
  back together decodes together (no trickle of small decodes)."""
  class SlowTool(CountdownEnv):
    def step(self, action):
      time.sleep(0.3)
      return super().step(action)

  sampler = Sampler(model, num_slots=8, cache_length=256, max_decode_length=4,
                    length_buckets=(16, 32, 64))
  engine = RolloutEngine(SlowTool, tok, T.CHATML, sampler, RolloutConfig(
      max_turns=3, max_action_tokens=4, env_workers=8, max_decode_batch=4,
      batch_wait_s=0.15))
  calls, decode = [], sampler.decode

  def logged(state, slots, **kwargs):
    t0 = time.perf_counter()
    out = decode(state, slots, **kwargs)
    calls.append((t0, time.perf_counter(), sorted(slots)))
    return out

  sampler.decode = logged
  trajs = engine.run(_tasks(8, steps=(3,))).trajectories
  assert [t.num_turns for t in trajs] == [3] * 8
  cohorts = [slots for _, _, slots in calls]
  assert [len(c) for c in cohorts] == [4] * 6
  assert cohorts[0::2] == [cohorts[0]] * 3 and cohorts[1::2] == [cohorts[1]] * 3
  # The second cohort's first decode did not wait for the first cohort's tools.
  assert calls[1][0] - calls[0][1] < 0.1


def test_carried_episodes_decode_before_new_ones(tok, sampler):
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler, RolloutConfig(
      max_turns=4, max_action_tokens=8, max_decode_batch=2, lockstep=True))
  calls, decode = [], sampler.decode
  sampler.decode = lambda state, slots, **kw: calls.append(sorted(slots)) or decode(
      state, slots, **kw)
  try:
    assert engine.run(_tasks(2, steps=(4,)), token_budget=8).trajectories == []
    carried = calls[-1]
    calls.clear()
    engine.run(_tasks(2, steps=(4,)), token_budget=8)
  finally:
    sampler.decode = decode
  assert calls[0] == carried, "the longest-waiting episodes go first"


def test_lockstep_runs_are_reproducible(tok, sampler):
  def run():
    engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler, RolloutConfig(
        max_turns=4, max_action_tokens=8, lockstep=True, max_decode_batch=3))
    trajs = engine.run(_tasks(4), group_size=2, seed=5).trajectories
    engine.close()
    return [[s.token_ids for s in t.segments] for t in trajs]

  first = run()
  assert len({str(ids) for ids in first}) > 1, "the episodes differ from each other"
  for _ in range(2):
    assert run() == first


def test_partial_rollouts_carry_over_and_reprefill(tok, model, sampler):
  # Version 0 samples with the model's weights, every later version with
  # perturbed ones: a carried episode whose cache was not rebuilt after the
  # change would sample its later turns from stale keys and values.
  graphdef, params = nnx.split(model)
  other = nnx.merge(graphdef, jax.tree.map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(7), x.shape, x.dtype), params))
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=4, max_action_tokens=8))
  try:
    first = engine.run(_tasks(2, steps=(4,)), group_size=2, token_budget=8,
                       policy_version=0)
    assert first.trajectories == []  # nobody can finish 4 turns on 8 tokens
    sampler.update_params(other)
    seen, returned_at = [], []
    for version in (1, 2, 3, 4, 5):
      got = engine.run([], policy_version=version).trajectories
      seen, returned_at = seen + got, returned_at + [version] * len(got)
      if len(seen) == 4:
        break
  finally:
    sampler.update_params(model)
  assert len(seen) == 4
  versions = [t.metadata["policy_versions"] for t in seen]
  assert all(len(v) == 4 and v == sorted(v) for v in versions)
  assert any(v[0] == 0 for v in versions), "the budget cut a version-0 episode"
  assert any(len(set(v)) > 1 for v in versions), "episodes span policy versions"
  # Staleness: the version being trained now minus the oldest that sampled it.
  assert [t.metadata["staleness"] for t in seen] == [
      now - v[0] for now, v in zip(returned_at, versions)]
  # Each turn re-scores exactly under the weights of the version that sampled
  # it: after the change the carried episodes were re-prefilled.
  batch = collate(seen, buckets=(256,))
  turn_version = np.full(batch.tokens.shape, -1)
  for i, v in enumerate(versions):
    for k, version in enumerate(v):
      turn_version[(batch.seq_ids == i) & (batch.turn_index == k)] = version
  for m, on in ((model, turn_version == 0), (other, turn_version > 0)):
    logits = m(jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
               jnp.asarray(batch.seq_ids))
    lp = np.asarray(losses.token_logprobs(logits, jnp.asarray(batch.tokens)))
    assert on.any()
    np.testing.assert_allclose(lp[on], batch.old_logprobs[on], atol=1e-4)


def _ids_and_logprobs(trajs):
  return [[(s.token_ids, s.logprobs) for s in t.segments] for t in trajs]


def test_an_evaluation_between_partial_rollouts_uses_every_slot_and_changes_nothing(
    tok, sampler):
  # 4 carried episodes hold all 4 slots; the evaluation needs 6 episodes.
  def engine():
    return RolloutEngine(CountdownEnv, tok, T.CHATML, sampler, RolloutConfig(
        max_turns=4, max_action_tokens=8, lockstep=True))

  def carried_engine():
    e = engine()
    first = e.run(_tasks(2, steps=(4,)), group_size=2, token_budget=8, seed=1)
    assert first.trajectories == []
    assert e.carried == 4 and not e._free  # pylint: disable=protected-access
    return e

  evaluation = lambda e: e.run(_tasks(3), group_size=2, temperature=0.0, isolated=True)
  with_eval, without = carried_engine(), carried_engine()
  got = evaluation(with_eval)
  # The same episodes as on an engine that carries nothing.
  assert _ids_and_logprobs(got.trajectories) == _ids_and_logprobs(
      evaluation(engine()).trajectories)
  assert len(got.trajectories) == 6 and with_eval.carried == 4
  # The carried episodes go on exactly as without the evaluation: from their
  # restored caches (the same policy version: no re-prefill) and the
  # sampler's random stream as it was (no seed).
  after = with_eval.run([]).trajectories
  assert len(after) == 4
  assert _ids_and_logprobs(after) == _ids_and_logprobs(without.run([]).trajectories)


def test_an_isolated_run_records_the_policy_version_it_is_given(tok, sampler):
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=4, max_action_tokens=8))
  engine.run(_tasks(1, steps=(4,)), token_budget=4, policy_version=2)
  got = engine.run(_tasks(2), temperature=0.0, isolated=True, policy_version=3)
  assert [t.metadata["policy_versions"] for t in got.trajectories] == [[3], [3, 3]]
  assert [t.metadata["staleness"] for t in got.trajectories] == [0, 0]
  # The carried episode goes on as version 2's.
  (carried,) = engine.run([], policy_version=2).trajectories
  assert carried.metadata["policy_versions"] == [2] * 4


def test_prompts_sharing_a_prefix_compute_it_once(tok, model):
  """The system turn shared by every prompt is computed once and forked into
  each slot: the episodes are those of prompts computed whole, with fewer
  tokens fed; a prefix kept by one call is not reused by the next (its
  weights may have changed)."""
  sampler = Sampler(model, num_slots=4, cache_length=256, max_decode_length=16,
                    length_buckets=(16, 32, 64))
  other = models.Decoder(models.tiny_config("llama"), rngs=nnx.Rngs(2))

  def engine(share):
    return RolloutEngine(CountdownEnv, tok, T.CHATML, sampler, RolloutConfig(
        max_turns=2, max_action_tokens=8, lockstep=True, min_shared_prefix=share,
        system_prompt="Say anything at all, in as few words as you like. " * 3))

  def run(share, tasks, group_size, on=None):
    return (on or engine(share)).run(tasks, group_size=group_size, temperature=0.0)

  def same(a, b):
    assert [[s.token_ids for s in t.segments] for t in a.trajectories] == [
        [s.token_ids for s in t.segments] for t in b.trajectories]
    for ta, tb in zip(a.trajectories, b.trajectories):
      for sa, sb in zip(ta.segments, tb.segments):
        if sa.logprobs is not None:
          np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)

  # 6 episodes on 4 slots: 4 prompts share the prefix, 2 later ones reuse it.
  tasks = _tasks(3, steps=(2,))
  whole, shared = run(0, tasks, 2), run(32, tasks, 2)
  same(whole, shared)
  prompts = [t.segments[0].token_ids for t in whole.trajectories]
  n = next(i for i in range(len(prompts[0])) if len({p[i] for p in prompts}) > 1)
  assert n >= 32
  assert whole.metrics["sampler_fed_tokens"] - shared.metrics["sampler_fed_tokens"] == 5 * n
  _assert_rescored(model, collate(shared.trajectories, buckets=(256,)))
  # Identical prompts (one task's group): all but each one's last token.
  same(run(0, tasks[:1], 4), run(32, tasks[:1], 4))
  # New weights between two calls of one engine: the second call's
  # episodes are the new weights' own.
  kept = engine(32)
  run(32, tasks, 2, on=kept)
  sampler.update_params(other)
  same(run(0, tasks, 2), run(32, tasks, 2, on=kept))
  sampler.update_params(model)


@pytest.fixture(scope="module")
def long_sampler(model):
  return Sampler(model, num_slots=4, cache_length=512, max_decode_length=12,
                 length_buckets=(32, 128, 512))


def test_a_prompt_longer_than_the_cache_is_dropped_at_reset(tok, sampler):
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_action_tokens=8, system_prompt="x " * 300))
  with pytest.warns(RuntimeWarning, match="no room for rollout.min_action_tokens=1"):
    result = engine.run(_tasks(1))
  assert result.trajectories == [] and result.metrics["ended/prompt_too_long"] == 1
  (failed,) = result.failed
  assert failed["stop_reason"] == "prompt_too_long"
  assert "leaves no room for 1 action tokens in 256" in failed["env_error"]
  assert sorted(engine._free) == list(range(sampler.num_slots))  # no slot was taken


@pytest.mark.parametrize("name", ["search_qa", "calculator", "frozen_lake", "python_tool",
                                  "sokoban"])
def test_every_bundled_env_end_to_end(name, tok, model, long_sampler):
  """Tiny model + bundled tokenizer on each bundled env: the flattened
  trajectories re-score to the rollout's log-probs, masks cover exactly the
  sampled tokens, group members never share an environment."""
  from agentrl_jax import envs
  made = []

  def factory():
    made.append(envs.make(name))
    return made[-1]

  cls = envs.env_class(name)
  engine = RolloutEngine(factory, tok, T.CHATML, long_sampler,
                         RolloutConfig(max_turns=2, max_action_tokens=12,
                                       max_observation_tokens=48, lockstep=True),
                         seed=3)
  trajs = engine.run(cls.tasks("train", 2, 0), group_size=2).trajectories
  assert len(trajs) == 4
  assert len({id(e) for e in made}) == len(made) == 5  # 4 episodes + the probe
  batch = collate(trajs, buckets=(512,))
  on = _assert_rescored(model, batch)
  for i, t in enumerate(trajs):
    sampled = [x for s in t.segments if s.role == Role.ASSISTANT for x in s.token_ids]
    assert list(batch.tokens[i][on[i]]) == sampled
    assert t.terminated or t.truncated


def test_sliding_window_context_matches_what_the_sampler_saw(tok, model, sampler):
  CountdownEnv.instances.clear()
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=5, max_action_tokens=8, context_window=2))
  trajs = engine.run(_tasks(2, steps=(5,)), group_size=2).trajectories
  assert len(trajs) == 4
  for t in trajs:
    assert t.terminated and t.num_turns == 5
    # Segments: prompt 0, action k at 1 + 2k. Actions 0-2 saw every turn;
    # from action 3 on the window holds the prompt and the last 2 turns.
    assert t.context_starts == [1, 1, 1, 3, 5]
    assert t.num_views == 3
  batch = collate(trajs, buckets=(128, 256))
  assert batch.tokens.shape[0] == 12
  # Teacher-forcing each action in its window reproduces the sampler's
  # log-probs; teacher-forcing the whole flattened episode does not.
  on = _assert_rescored(model, batch)
  assert on.sum() == sum(len(s) for t in trajs for s in t.segments if s.role == Role.ASSISTANT)
  whole = collate([dataclasses.replace(t, context_starts=None) for t in trajs],
                  buckets=(128, 256))
  logits = model(jnp.asarray(whole.tokens), jnp.asarray(whole.positions),
                 jnp.asarray(whole.seq_ids))
  lp = np.asarray(losses.token_logprobs(logits, jnp.asarray(whole.tokens)))
  late = whole.turn_index >= 3
  assert np.abs(lp[late] - whole.old_logprobs[late]).max() > 1e-2
  with pytest.raises(ValueError, match="context_window"):
    RolloutEngine(CountdownEnv, tok, T.CHATML, sampler, RolloutConfig(context_window=0))


def test_branch_replays_the_prefix_and_samples_on(tok, model, sampler):
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=3, max_action_tokens=8))
  tasks = _tasks(2, steps=(5,))
  trajs = engine.run(tasks, seed=0).trajectories
  conts = engine.branch([(tasks[0], trajs[0], 2), (tasks[1], trajs[1], 0)], 3, seed=1)
  assert [len(c) for c in conts] == [3, 3]
  for c in conts[0]:
    assert c.segments[:5] == trajs[0].segments[:5]  # prompt + 2 replayed turns
    assert c.turn_rewards[:2] == trajs[0].turn_rewards[:2]
    # max_turns counts the replayed turns: one new turn, then the budget.
    assert c.num_turns == 3 and c.truncated and c.metadata["stop_reason"] == "max_turns"
  assert len({c.segments[5].token_ids for c in conts[0]}) > 1, "sampled afresh"
  assert all(c.segments[:1] == trajs[1].segments[:1] for c in conts[1])
  # The slot was prefilled with the recorded tokens: the model re-scores the
  # new actions exactly (and the replayed ones, recorded by the same model).
  _assert_rescored(model, collate(conts[0] + conts[1], buckets=(256,)))

  class Unreplayable(CountdownEnv):
    resets = iter(range(10**6))

    def reset(self, task):
      super().reset(task)
      return f"Attempt {next(self.resets)}.", {}

  engine = RolloutEngine(Unreplayable, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=3, max_action_tokens=8))
  (traj,) = engine.run(tasks[:1]).trajectories
  with pytest.raises(ValueError, match="replays exactly"):
    engine.branch([(tasks[0], traj, 1)], 2)


def test_branches_fork_the_kept_cache_and_compute_only_new_tokens(tok, model, sampler):
  # 6 episodes on 4 slots: finished episodes' slots are reused during the
  # run, so a continuation can only fork from the kept snapshot. (No
  # shared prompt prefix: the tokens fed count the forks' savings alone.)
  cfg = RolloutConfig(max_turns=4, max_action_tokens=8, min_shared_prefix=0)
  tasks = _tasks(3, steps=(5,))
  points = lambda trajs: [(tasks[i // 2], trajs[i], t) for i in (0, 3, 5) for t in (0, 1, 3)]
  prefixes = lambda trajs: [sum(len(s) for s in trajs[i].segments[:1 + 2 * t])
                            for i in (0, 3, 5) for t in (0, 1, 3)]
  conts, metrics = {}, {}
  for keep in (True, False):
    engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler, cfg)
    trajs = engine.run(tasks, group_size=2, seed=0, policy_version=4,
                       keep_caches=keep).trajectories
    assert ("snapshot_id" in trajs[0].metadata) == keep
    conts[keep] = engine.branch(points(trajs), 2, seed=1, temperature=0.0, policy_version=4)
    metrics[keep] = m = engine.branch_metrics
    assert m["continuations"] == 18 and m["forked"] == (18 if keep else 0)
  # Greedy continuations are the same whether the prefix was forked or
  # prefilled; the fork fed one token per continuation instead of its prefix.
  for a, b in zip(conts[True], conts[False]):
    assert [[s.token_ids for s in c.segments] for c in a] == [
        [s.token_ids for s in c.segments] for c in b]
    for ca, cb in zip(a, b):
      for sa, sb in zip(ca.segments, cb.segments):
        if sa.logprobs is not None:
          np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-4)
  saved = 2 * sum(n - 1 for n in prefixes(trajs))
  assert metrics[False]["fed_tokens"] - metrics[True]["fed_tokens"] == saved > 0
  assert metrics[True]["generated_tokens"] == metrics[False]["generated_tokens"]
  # The forked keys/values are the prefix's: the trainer re-scores the new
  # actions (and the replayed ones) exactly.
  _assert_rescored(model, collate([c for cs in conts[True] for c in cs], buckets=(256,)))

  # Snapshots of other weights are not forked; a branch drops them.
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler, cfg)
  trajs = engine.run(tasks[:1], group_size=2, policy_version=0, keep_caches=True).trajectories
  engine.branch([(tasks[0], trajs[0], 1)], 2, policy_version=1)
  assert engine.branch_metrics["forked"] == 0
  trajs = engine.run(tasks[:1], group_size=2, policy_version=1, keep_caches=True).trajectories
  engine.branch([(tasks[0], trajs[0], 1)], 2, policy_version=1)
  assert engine.branch_metrics["forked"] == 2
  engine.branch([(tasks[0], trajs[0], 1)], 2, policy_version=1)
  assert engine.branch_metrics["forked"] == 0
  with pytest.raises(ValueError, match="keep_caches is for branching"):
    engine.run(tasks[:1], keep_caches=True, token_budget=10)


def test_the_state_of_every_turn_is_recorded_also_through_a_branch(tok, sampler):
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=3, max_action_tokens=8))
  tasks = _tasks(2, steps=(5, 2))
  trajs = engine.run(tasks, seed=0).trajectories
  # The key of the state each action was taken in: "left" before the action.
  assert trajs[0].metadata["state_keys"] == [("left", 5), ("left", 4), ("left", 3)]
  assert trajs[1].metadata["state_keys"] == [("left", 2), ("left", 1)]
  (conts,) = engine.branch([(tasks[0], trajs[0], 2)], 2, seed=1)
  for c in conts:  # two replayed turns, one sampled
    assert c.metadata["state_keys"] == [("left", 5), ("left", 4), ("left", 3)]


def test_the_tokenizers_eos_always_stops_an_action(tok, sampler):
  # A format with no stop strings and an env without any: greedy actions run
  # to the token budget. Make the first greedy token the tokenizer's EOS:
  # the same action must now end right there.
  bare = T.ChatFormat(name="bare", prompt="{system}\n{task}\n",
                      observation="\nObs: {observation}\n", end_of_turn="", stops=())
  cfg = RolloutConfig(max_turns=1, max_action_tokens=8)
  first = RolloutEngine(_Quiet, tok, bare, sampler, cfg).run(
      _tasks(1), temperature=0.0).trajectories[0]
  action = first.segments[1].token_ids
  assert len(action) == 8 and first.metadata["stop_reasons"] == [2]  # STOP_BUDGET
  eos_tok = T.load_tokenizer()
  eos_tok.eos_token = eos_tok.convert_ids_to_tokens(action[0])
  assert eos_tok.eos_token_id == action[0] != tok.eos_token_id
  engine = RolloutEngine(_Quiet, eos_tok, bare, sampler, cfg)
  assert engine.stops.scan(action) == 0  # the EOS id stops, whatever it spells
  again = engine.run(_tasks(1), temperature=0.0).trajectories[0]
  assert again.segments[1].token_ids == action[:1]
  assert again.metadata["stop_reasons"] == [1]  # STOP_SEQUENCE


class _Quiet(CountdownEnv):
  stop_strings = ()


class _TruncatingEnv(CountdownEnv):
  """Truncates itself (its own time limit) at its second step."""

  def step(self, action):
    result = super().step(action)
    return dataclasses.replace(result, truncated=len(self.seen) >= 3, terminated=False)


@pytest.mark.parametrize("env, max_turns, reason", [(CountdownEnv, 2, "max_turns"),
                                                    (_TruncatingEnv, 4, "env_truncated")])
def test_gae_bootstraps_a_real_truncated_rollout_where_the_value_head_trains(
    tok, env, max_turns, reason):
  from agentrl_jax import train
  from agentrl_jax.train import credit
  model = models.Decoder(models.tiny_config("llama", value_head=True), rngs=nnx.Rngs(3))
  sampler = Sampler(model, num_slots=4, cache_length=256, max_decode_length=16,
                    length_buckets=(16, 32, 64))
  engine = RolloutEngine(env, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=max_turns, max_action_tokens=6))
  trajs = engine.run(_tasks(2, steps=(9,)), group_size=2).trajectories
  for i, t in enumerate(trajs):
    t.metadata["group_id"] = i // 2
    assert t.truncated and t.metadata["stop_reason"] == reason and t.num_turns == 2
    # It ends in the state after its last action: the observation delta,
    # which ends with the next assistant header, like every decision state.
    assert [s.role for s in t.segments[-2:]] == [Role.ASSISTANT, Role.OBSERVATION]
    assert tok.decode(t.segments[-1].token_ids).endswith("<|im_start|>assistant\n")
  batch = collate(trajs, buckets=(256,))
  values = np.asarray(model.values(model.hidden_states(
      jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
      seq_ids=jnp.asarray(batch.seq_ids))[0]))
  turn_values, bootstrap = credit.turn_values_from_tokens(values, batch, 4, 2)
  decision = np.asarray(train.decision_mask(jnp.asarray(batch.turn_index)))
  for i, t in enumerate(trajs):
    last = len(t) - 1
    # The bootstrap is the value at the trajectory's last token, which holds
    # the same token as the positions the value loss trains (decision_mask).
    assert bootstrap[i] == values[i, last]
    assert batch.tokens[i, last] in set(batch.tokens[decision])
    assert set(batch.tokens[decision]) == {batch.tokens[i, last]}
  got = credit.assign("gae", trajs, batch, gamma=0.9, lam=1.0, num_turns=2,
                      token_values=values)
  for i, t in enumerate(trajs):
    r = t.turn_rewards
    # lam = 1: A_1 = r_1 + gamma V(s_2) - V(s_1), V(s_2) the bootstrap.
    want = r[1] + 0.9 * bootstrap[i] - turn_values[i, 1]
    on = (batch.seq_ids == i) & (batch.turn_index == 1)
    np.testing.assert_allclose(got.advantages[on], want, rtol=1e-5, atol=1e-6)


def test_gae_bootstrap_under_a_sliding_window_is_read_in_the_next_actions_window(tok):
  from agentrl_jax.train import credit
  model = models.Decoder(models.tiny_config("llama", value_head=True), rngs=nnx.Rngs(3))
  sampler = Sampler(model, num_slots=2, cache_length=256, max_decode_length=16,
                    length_buckets=(16, 32, 64))
  engine = RolloutEngine(CountdownEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=3, max_action_tokens=6, context_window=1))
  trajs = engine.run(_tasks(2, steps=(9,))).trajectories
  for t in trajs:
    assert t.metadata["stop_reason"] == "max_turns" and t.num_turns == 3
    # Segments: prompt 0, action k at 1 + 2k, the final observation at 6.
    # The next action would have seen the prompt and the last turn only.
    assert t.context_starts == [1, 1, 3, 5] and t.num_views == 3
  batch = collate(trajs, buckets=(256,))
  values = np.asarray(model.values(model.hidden_states(
      jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
      seq_ids=jnp.asarray(batch.seq_ids))[0]))
  _, bootstrap = credit.turn_values_from_tokens(values, batch, len(trajs), 3)
  for i, t in enumerate(trajs):
    # Independently: the value head on prompt + last action + final state.
    ids = [x for k in (0, 5, 6) for x in t.segments[k].token_ids]
    alone = model.values(model.hidden_states(
        jnp.asarray([ids]), jnp.arange(len(ids))[None], seq_ids=jnp.zeros((1, len(ids)), jnp.int32))[0])
    np.testing.assert_allclose(bootstrap[i], alone[0, -1], rtol=1e-5, atol=1e-6)


_RELEASE = threading.Event()  # set at the end of the fault test: hung calls return


class FaultyEnv(CountdownEnv):
  """CountdownEnv that misbehaves as task.data["fault"] says, on its first step
  (or in reset); "" behaves."""

  def reset(self, task):
    self.fault = task.data["fault"]
    if self.fault == "reset_hangs":
      _RELEASE.wait(600)
    if self.fault == "reset_raises":
      raise OSError("no such task")
    if self.fault == "reset_returns_str":
      return "just a string"
    return super().reset(task)

  def step(self, action):
    result = super().step(action)
    fault, self.fault = self.fault, ""  # the first step only
    bad = {
        "step_raises": lambda: 1 / 0,
        "step_exits": lambda: sys.exit(3),
        "step_hangs": lambda: _RELEASE.wait(600),
        "obs_int": lambda: dataclasses.replace(result, observation=12345),
        "obs_none": lambda: dataclasses.replace(result, observation=None),
        "obs_bytes": lambda: dataclasses.replace(result, observation=b"bytes"),
        "obs_surrogate": lambda: dataclasses.replace(result, observation="a\ud800b"),
        "three_tuple": lambda: ("obs", 0.0, False),
        "info_none": lambda: dataclasses.replace(result, info=None),
        "reward_nan": lambda: dataclasses.replace(result, reward=float("nan")),
        "reward_str": lambda: dataclasses.replace(result, reward="1"),
        "flag_str": lambda: dataclasses.replace(result, terminated="no"),
        "parts_str": lambda: dataclasses.replace(result, info={"reward_parts": "x"}),
    }
    if fault == "obs_10mb":
      return dataclasses.replace(result, observation="word " * 2_000_000)
    if fault == "slow":
      time.sleep(0.5)
    if fault in bad:
      out = bad[fault]()
      return result if fault == "step_hangs" else out
    return result


_ERRORS = {  # fault -> (stop reason, start of the recorded error text)
    "step_raises": ("env_error", "ZeroDivisionError"),
    "step_exits": ("env_error", "SystemExit: 3"),
    "step_hangs": ("env_timeout", "no answer within the 1 s deadline"),
    "obs_int": ("env_error", "ContractError: step observation must be a str or a list of strs, got int"),
    "obs_none": ("env_error", "ContractError: step observation must be a str or a list of strs, got NoneType"),
    "obs_bytes": ("env_error", "ContractError: step observation must be a str or a list of strs, got bytes"),
    "obs_surrogate": ("env_error", "ContractError: step observation is not valid Unicode"),
    "three_tuple": ("env_error", "ContractError: step must return a StepResult, got a tuple of 3"),
    "info_none": ("env_error", "ContractError: step info must be a dict, got NoneType"),
    "reward_nan": ("env_error", "ContractError: step reward must be a finite number"),
    "reward_str": ("env_error", "ContractError: step reward must be a finite number"),
    "flag_str": ("env_error", "ContractError: step terminated must be a bool, got str"),
    "parts_str": ("env_error", "ContractError: step info['reward_parts'] must map"),
}
_RESET_ERRORS = {
    "reset_hangs": ("env_timeout", "no answer within the 1 s deadline"),
    "reset_raises": ("env_error", "OSError: no such task"),
    "reset_returns_str": ("env_error", "ContractError: reset must return (observation, info)"),
}


def test_a_batch_survives_envs_that_hang_raise_and_return_garbage(tok, sampler):
  """Good episodes mixed with every fault: the good ones come back whole,
  each bad one ends labelled, in bounded time, and the engine stays usable."""
  faults = ["", "slow", "obs_10mb", *_ERRORS, *_RESET_ERRORS]
  tasks = [Task(f"t{i}", "go", {"steps": 2, "fault": f}) for i, f in enumerate(faults)]
  engine = RolloutEngine(FaultyEnv, tok, T.CHATML, sampler, RolloutConfig(
      max_turns=3, max_action_tokens=8, max_observation_tokens=32, env_deadline_s=1.0))
  try:
    t0 = time.perf_counter()
    result = engine.run(tasks, group_size=2)
    # Outside decoding (compiles included), the batch waited ~1 s: the hung
    # calls' deadline, all of them at once, and 0.5 s for the slow step.
    assert time.perf_counter() - t0 - result.metrics["generation_s"] < 20
    by_fault = collections.defaultdict(list)
    for t in result.trajectories:
      by_fault[faults[int(t.metadata["task_id"][1:])]].append(t)
    for f in result.failed:
      by_fault[faults[int(f["task_id"][1:])]].append(f)
    assert {f: len(v) for f, v in by_fault.items()} == {f: 2 for f in faults}
    for fault in ("", "slow", "obs_10mb"):  # complete, and trainable
      for t in by_fault[fault]:
        assert t.terminated and t.num_turns == 2 and t.metadata["stop_reason"] == "terminated"
        t.validate()
    for t in by_fault["obs_10mb"]:
      observation = tok.decode(t.segments[2].token_ids)
      assert "...[truncated 99999" in observation and len(t.segments[2]) < 100
    for fault, (reason, text) in _ERRORS.items():
      for t in by_fault[fault]:
        assert (t.metadata["stop_reason"], t.truncated, t.num_turns) == (reason, True, 1)
        assert t.metadata["env_error"].startswith(text), t.metadata["env_error"]
        t.validate()
    for fault, (reason, text) in _RESET_ERRORS.items():
      for f in by_fault[fault]:
        assert f["stop_reason"] == reason and f["env_error"].startswith(text)
    m = result.metrics
    assert m["ended/terminated"] == 6 and m["ended/env_timeout"] == 4
    assert m["ended/env_error"] == 2 * (len(_ERRORS) + len(_RESET_ERRORS)) - 4
    assert m["env_calls_abandoned"] == 4 == engine.abandoned_calls
    assert m["env_call_max_s"] >= 1.0 and m["env_call_p50_s"] < 0.5
    # Usable afterwards: every slot came back, the next batch runs.
    again = engine.run(tasks[:2], group_size=2).trajectories
    assert [t.metadata["stop_reason"] for t in again] == ["terminated"] * 4
  finally:
    _RELEASE.set()
    t0 = time.perf_counter()
    engine.close()
    assert time.perf_counter() - t0 < 5
