"""The RL loop measurably improves held-out success from a fixed SFT start.

A two-turn toy task: the agent must look up a hidden label (`<ask>`), then
answer it (`<answer>`). The SFT expert is lazy: 70% of the time it skips the
lookup and answers "left". Keeping only its successful demos, SFT learns to
skip about half the time (and then succeed half the time): imperfect. GRPO on
the outcome reward must learn to always look up, raising held-out success
(measured by sampling at temperature 1, the policy RL optimises). Everything
is seeded and the rollout runs in lockstep: the test is deterministic.
"""

import itertools
import random
import re
import types
import warnings

from flax import nnx
import jax
import numpy as np
import optax
import pytest

from agentrl_jax import advantages as adv
from agentrl_jax import models, train
from agentrl_jax import tokenizer as T
from agentrl_jax.envs import Task, TextEnvironment
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax.sampling import Sampler
from agentrl_jax.train import credit, rl, sft
from agentrl_jax.train import step as step_lib
from agentrl_jax.trajectory import TokenBatch

LABELS = ("left", "right")


class LookupEnv(TextEnvironment):
  system_prompt = "Ask for the label, then answer it."
  stop_strings = ("</ask>", "</answer>")

  def _reset(self, task):
    return task.prompt

  def _step(self, action):
    if "<ask>" in action:
      return f"label: {self.task.data['label']}", {}, False, {"tool_call": True}
    if "<answer>" in action:
      right = f"<answer>{self.task.data['label']}</answer>" in action
      return "done", {"outcome": float(right)}, True, {}
    return self.malformed(["<ask>label</ask>", "<answer>label</answer>"])

  @classmethod
  def tasks(cls, split, n, seed):
    rng = random.Random(f"{split}-{seed}")
    return [Task(f"{split}{i}", f"Item {rng.randint(0, 10**6)}.",
                 {"label": rng.choice(LABELS)}) for i in range(n)]

  @classmethod
  def expert(cls, task):
    if random.Random(task.task_id).random() < 0.7:
      actions = iter(["<answer>left</answer>"])
    else:
      actions = iter(["<ask>label</ask>", f"<answer>{task.data['label']}</answer>"])
    return lambda observation: next(actions)


def test_rl_improves_held_out_success_from_sft():
  tok = T.load_tokenizer()
  model = models.Decoder(models.tiny_config("llama"), rngs=nnx.Rngs(0))
  sampler = Sampler(model, num_slots=128, cache_length=128, max_decode_length=8,
                    length_buckets=(16, 64), attention_windows=(128,))  # fewer compiles
  engine = RolloutEngine(LookupEnv, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=3, max_action_tokens=8, lockstep=True))
  train_tasks = LookupEnv.tasks("train", 256, 0)
  eval_tasks = LookupEnv.tasks("test", 128, 0)
  tx = optax.adam(2e-3)
  graphdef, state = train.init_train_state(model, tx, with_reference=False)

  demos = sft.expert_demos(engine, train_tasks)  # the successful ones
  assert 0.55 < len(demos) / len(train_tasks) < 0.75
  state = sft.distill(train.SFTStep(graphdef, tx), state, demos, steps=60,
                      batch_size=16, buckets=(128,), seed=0)
  sampler.update_params(state.params)
  before = rl.evaluate(engine, eval_tasks, temperature=1.0)["success"]

  rl_tx = optax.adam(3e-4)  # RL fine-tunes gently: 2e-3 collapses the policy
  trainer = rl.RLTrainer(
      engine, train.RLStep(graphdef, rl_tx, train.LossConfig()),
      state.replace(opt_state=rl_tx.init(state.params)),
      rl.RLConfig(group_size=8, tasks_per_iteration=8, buckets=(128,)), seed=0)
  for it in range(20):
    tasks = [train_tasks[(8 * it + j) % len(train_tasks)] for j in range(8)]
    trainer.iteration(tasks, it + 1)
  after = rl.evaluate(engine, eval_tasks, temperature=1.0)["success"]
  print(f"held-out success: SFT {before:.3f} -> RL {after:.3f}")
  # Measured here: 0.453 -> 0.820 (0.648 -> 0.844 before the train step
  # summed in chunks): the SFT start moves with float rounding; the gain holds.
  assert after >= before + 0.1, (before, after)


def test_curriculum_pool():
  tasks = [Task("easy", "", level=0), Task("hard", "", level=1)]
  schedule = ((0, (0,)), (5, (0, 1)))
  assert [t.task_id for t in rl.curriculum_pool(tasks, schedule, 4)] == ["easy"]
  assert [t.task_id for t in rl.curriculum_pool(tasks, schedule, 5)] == ["easy", "hard"]
  assert len(rl.curriculum_pool(tasks, (), 0)) == 2
  with pytest.raises(ValueError, match="no task has them"):
    rl.curriculum_pool(tasks, ((0, (2,)),), 0)


def _trainer(rollout_kw, rl_kw, loss_kw=None, value_head=False, env=LookupEnv,
             policy_temperature=1.0):
  """An RL trainer of a random tiny policy on 2 tasks x 2 rollouts."""
  model = models.Decoder(models.tiny_config("llama", value_head=value_head),
                         rngs=nnx.Rngs(0))
  sampler = Sampler(model, num_slots=16, cache_length=128, max_decode_length=8,
                    length_buckets=(16, 64), policy_temperature=policy_temperature)
  engine = RolloutEngine(env, T.load_tokenizer(), T.CHATML, sampler,
                         RolloutConfig(max_turns=3, max_action_tokens=8, lockstep=True,
                                       **rollout_kw))
  tx = optax.adam(1e-4)
  graphdef, state = train.init_train_state(model, tx, with_reference=False)
  return rl.RLTrainer(
      engine, train.RLStep(graphdef, tx, train.LossConfig(**(loss_kw or {}))), state,
      rl.RLConfig(**{"group_size": 2, "tasks_per_iteration": 2, "buckets": (128,), **rl_kw}),
      seed=0)


def _one_iteration(*args, **kwargs):
  return _trainer(*args, **kwargs).iteration(LookupEnv.tasks("train", 2, 0), 1)


def test_rl_iteration_with_a_sliding_window_trains_every_action_once():
  m = _one_iteration({"context_window": 1}, {"credit": "gae"}, {"value_coef": 0.1},
                     value_head=True)
  # The random policy rambles: episodes reach the third turn, whose window
  # (prompt + the previous turn only) is a second view of the episode.
  assert m["rollout/turns_max"] == 3
  assert m["train/batch_tokens"] == m["rollout/action_tokens_mean"] * m["rollout/episodes"]
  assert m["train/skipped_updates"] == 0


def test_the_sampler_holds_no_weights_during_a_synchronous_step():
  """Its copy is replaced after the step: kept through it, its bytes would
  add to the step's peak. After the iteration it samples the new weights."""
  trainer = _trainer({}, {})
  sampler, step = trainer.engine.sampler, trainer.step
  seen = []

  class Spy:
    def __getattr__(self, name):
      return getattr(step, name)

    def __call__(self, *args, **kwargs):
      seen.append(sampler.params)
      return step(*args, **kwargs)
  trainer.step = Spy()
  trainer.iteration(LookupEnv.tasks("train", 2, 0), 1)
  assert seen == [None]
  for a, b in zip(jax.tree.leaves(sampler.params), jax.tree.leaves(trainer.state.params)):
    np.testing.assert_array_equal(a, b)
  sampler.drop_params()
  with pytest.raises(RuntimeError, match="weights were dropped"):
    trainer.iteration(LookupEnv.tasks("train", 2, 0), 2)


def test_rl_iteration_with_branching_baselines():
  m = _one_iteration({}, {"credit": "branching", "branch_size": 2})
  # Every turn after the first is a branch point with 2 continuations.
  points = m["rollout/episodes"] * (m["rollout/turns_mean"] - 1)
  assert points > 0 and m["rollout/branch_episodes"] == 2 * points
  # Each forks its episode's kept cache (the rollout engine's tests check
  # what that computes).
  assert m["rollout/branch_forked"] == m["rollout/branch_episodes"]
  assert m["train/skipped_updates"] == 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_packed_iteration_makes_the_unpacked_update_on_fewer_rows(agg):
  tasks = LookupEnv.tasks("train", 2, 0)
  trainers, batches, metrics = {}, {}, {}
  layouts = {"rows": {}, "packed": {"pack": True},
             "tree": {"pack": True, "share_prompts": True}}
  for layout, kw in layouts.items():
    # Rows of 256 hold two or three of the random policy's episodes.
    trainer = trainers[layout] = _trainer(
        {}, {**kw, "pack_row_multiple": 1, "buckets": (256,)},
        {"agg": agg, "ppo_epochs": 2})
    step, seen = trainer.step, []

    class Spy:
      def __getattr__(self, name):
        return getattr(step, name)

      def __call__(self, state, batch, *args):
        seen.append(batch)
        return step(state, batch, *args)
    trainer.step = Spy()
    metrics[layout] = trainer.iteration(tasks, 1)
    batches[layout] = seen[0]
    assert metrics[layout]["train/rows"] == seen[0].tokens.shape[0]
  rows = {k: b.tokens.shape[0] for k, b in batches.items()}
  held = {k: int(np.sum((b.seq_ids >= 0) | (b.prefix_ids >= 0))) for k, b in batches.items()}
  # The same episodes (lockstep, the same seed), in fewer rows; the tree's
  # hold each group's prompt once.
  assert rows["rows"] == 4 and rows["tree"] <= rows["packed"] < rows["rows"], rows
  assert held["tree"] < held["packed"] == held["rows"], held
  for layout, b in batches.items():
    assert metrics[layout]["train/row_fill"] == held[layout] / b.tokens.size
    assert metrics[layout]["train/shared_tokens"] == held["rows"] - held[layout]
  for layout in ("packed", "tree"):
    for key in ("rollout/sampler_fed_tokens", "train/batch_tokens"):
      assert metrics[layout][key] == metrics["rows"][key]
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/approx_kl"):
      np.testing.assert_allclose(metrics[layout][key], metrics["rows"][key], rtol=1e-5,
                                 atol=1e-7, err_msg=f"{layout} {key}")
    for a, b in zip(jax.tree.leaves(trainers[layout].state.params),
                    jax.tree.leaves(trainers["rows"].state.params), strict=True):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_packing_rules():
  with pytest.raises(ValueError, match="pack_row_multiple"):
    rl.RLConfig(pack=True, pack_row_multiple=0)
  with pytest.raises(ValueError, match="share_prompts.*set pack=True"):
    rl.RLConfig(share_prompts=True)
  with pytest.raises(ValueError, match="micro_batches"):
    rl.check_sections(rl.RLConfig(pack=True, pack_row_multiple=3),
                      train.LossConfig(micro_batches=2), 128)


class _ShapedEnv(LookupEnv):
  """Two turns whatever the action: process reward +1, then -1 (return 0)."""

  def _step(self, action):
    first = self.turns == 1
    return "next" if first else "done", {"process": 1.0 if first else -1.0}, not first, {}


def _filtered_iteration(credit):
  trainer = _trainer({}, {"credit": credit, "filter_zero_variance": True}, env=_ShapedEnv)
  return trainer.iteration(LookupEnv.tasks("train", 2, 0), 1)


def test_filtering_drops_only_groups_whose_advantages_are_all_zero():
  # Every episode's return is 0, so every group is flat in reward: GRPO has
  # nothing to learn and the whole batch is dropped...
  m = _filtered_iteration("grpo")
  assert m["rollout/kept_frac"] == 0.0 and m["rollout/dropped_groups"] == 2.0
  assert m["train/skipped_batch"] == 1.0
  # ... but returns-to-go are [0, -1] per episode: per-turn signal, all kept.
  m = _filtered_iteration("turn_returns")
  assert m["rollout/kept_frac"] == 1.0 and m["rollout/dropped_groups"] == 0.0
  assert "train/skipped_batch" not in m and m["train/batch_tokens"] > 0


def test_partial_rollouts_in_the_rl_loop():
  # 12 sampled tokens per iteration cannot finish 4 rambling episodes of up
  # to 3 x 8 tokens: they carry over and finish under later policy versions.
  trainer = _trainer({}, {"token_budget": 12})
  tasks = LookupEnv.tasks("train", 8, 0)
  history = []
  for it in range(6):
    m = trainer.iteration(tasks[2 * it:2 * it + 2], it + 1)
    history.append(m)
    carried = trainer.engine.carried
    # An evaluation in between runs its own episodes and leaves those alone.
    rl.evaluate(trainer.engine, LookupEnv.tasks("test", 2, 0))
    assert trainer.engine.carried == carried == m["rollout/carried_episodes"]
  assert history[0]["train/skipped_batch"] == 1.0  # no group finished yet
  trained = [m for m in history if "train/loss" in m]
  assert trained and all(m["train/skipped_updates"] == 0 for m in trained)
  assert max(m["rollout/staleness_max"] for m in trained) >= 1
  assert sum(m["rollout/episodes"] for m in history) >= 8
  with pytest.raises(ValueError, match="partial rollouts"):
    _trainer({}, {"token_budget": 12, "credit": "branching"})


@credit.register("test_critic_baseline", needs_values=True, replace=True)
def _critic_baseline(x: credit.CreditInputs) -> credit.Credit:
  """Returns-to-go minus the value head's V(s_t); the critic learns the returns."""
  returns = adv.discounted_returns(x.turn_rewards, x.turn_mask, x.gamma)
  return credit.Credit(turns=returns - x.values * x.turn_mask, returns=returns)


def test_a_registered_scheme_trains_in_the_rl_loop():
  trainer = _trainer({}, {"credit": "test_critic_baseline"}, {"value_coef": 0.1},
                     value_head=True)
  losses = [trainer.iteration(LookupEnv.tasks("train", 2, 0), it)["train/value_loss"]
            for it in (1, 2)]
  # Its values were read (needs_values) and its returns trained the critic.
  assert all(l > 0 for l in losses) and losses[1] != losses[0]
  with pytest.raises(ValueError, match="credit = 'not_registered' must be one of"):
    _trainer({}, {"credit": "not_registered"})


def test_paired_gain_by_hand():
  # Tasks a-d in both (e only after): differences 1, 0, 0, 1: mean 0.5,
  # sample variance (4 x 0.25) / 3, SE sqrt(1/3) / 2.
  before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0}
  after = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 1.0, "e": 1.0}
  gain, se = rl.paired_gain(before, after)
  assert gain == pytest.approx(0.5) and se == pytest.approx(np.sqrt(1 / 3) / 2)
  # Nothing changed: no spread.
  assert rl.paired_gain(before, before) == (0.0, 0.0)
  gain, se = rl.paired_gain({"a": 0.0}, {"a": 1.0})
  assert gain == 1.0 and np.isnan(se)
  with pytest.raises(ValueError, match="share no task"):
    rl.paired_gain({"a": 1.0}, {"b": 1.0})


def test_pass_at_k_by_hand_and_by_enumeration():
  # n = 4 samples, c = 1 success: pass@2 = 1 - C(3, 2) / C(4, 2) = 1 - 3/6.
  assert rl.pass_at_k(4, 1, 2) == pytest.approx(0.5)
  # n = 5, c = 2, k = 2: 1 - C(3, 2) / C(5, 2) = 1 - 3/10.
  assert rl.pass_at_k(5, 2, 2) == pytest.approx(0.7)
  assert rl.pass_at_k(4, 0, 4) == 0.0 and rl.pass_at_k(4, 1, 4) == 1.0
  assert rl.pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 = c / n
  # Every k-subset of n outcomes, counted: the fraction holding a success.
  for n in range(1, 8):
    for c in range(n + 1):
      outcomes = [1] * c + [0] * (n - c)
      for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        want = sum(any(s) for s in subsets) / len(subsets)
        assert rl.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
  with pytest.raises(ValueError, match="1 <= k <= n"):
    rl.pass_at_k(3, 1, 4)


def test_evaluate_reports_pass_at_k_over_tasks():
  # Two tasks x 4 samples: task a succeeds once, task b never; one episode of
  # b ended on an environment fault and was not recorded (3 episodes).
  def traj(task, success):
    return types.SimpleNamespace(metadata={"task_id": task, "success": success})
  outcomes = [("a", 1), ("a", 0), ("a", 0), ("a", 0), ("b", 0), ("b", 0), ("b", 0)]

  class Engine:
    def run(self, tasks, samples, **kw):
      trajs = [traj(t, s) for t, s in outcomes]
      return types.SimpleNamespace(trajectories=trajs, metrics={
          "success_frac": 1 / 7, "reward_mean": 1 / 7, "turns_mean": 1.0,
          "truncated_frac": 0.0, "episodes": 7})

  m = rl.evaluate(Engine(), ["a", "b"], temperature=1.0, samples=4, seed=0)
  # pass@4: a has a success among its 4 (1.0); b none among its 3 (0.0).
  assert m["pass_at_4"] == pytest.approx(0.5)
  assert m["success"] == pytest.approx(1 / 7)  # avg@4 over the recorded episodes
  assert "pass_at_1" not in rl.evaluate(Engine(), ["a", "b"], samples=1)


def _packed_episodes() -> TokenBatch:
  """One row packs two episodes, then padding. Episode 0: prompt p p,
  action a a (turn 0, advantage 0.5), observation o o, action a (turn 1,
  0.5), observation o; episode 1: prompt p, action a (turn 0, -1.0),
  observation o."""
  seq = np.array([[0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1]], np.int32)
  turn = np.array([[-1, -1, 0, 0, -1, -1, 1, -1, -1, 0, -1, -1]], np.int32)
  mask = (turn >= 0).astype(np.float32)
  adv = np.where(mask > 0, np.where(seq == 0, 0.5, -1.0), 0.0).astype(np.float32)
  zeros = np.zeros_like(seq)
  return TokenBatch(tokens=zeros, loss_mask=mask, old_logprobs=mask * -0.3,
                    sampling_logprobs=mask * -0.3, advantages=adv, turn_index=turn, seq_ids=seq, positions=zeros,
                    returns=mask * 0, prefix_ids=np.full_like(seq, -1))


def test_observation_credit_by_hand():
  batch = _packed_episodes()
  out, added = rl.observation_credit(batch)
  # Each observation token after its episode's first action joins the loss
  # with the advantage of the action before it; prompts and padding do not.
  np.testing.assert_array_equal(added[0], [0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0])
  np.testing.assert_array_equal(out.loss_mask[0], [0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0])
  np.testing.assert_array_equal(out.advantages[0],
                                [0, 0, .5, .5, .5, .5, .5, .5, 0, -1, -1, 0])
  np.testing.assert_array_equal(out.old_logprobs, batch.old_logprobs)  # the caller's


def test_observation_tokens_in_the_loss_start_no_turn():
  # The value head trains where a turn's first action token is: with the
  # observations in the loss, still only there (positions 2, 6 and 9).
  out, _ = rl.observation_credit(_packed_episodes())
  weights = np.ones_like(out.loss_mask)
  acts = step_lib._actions(out, weights, 12)  # pylint: disable=protected-access
  first = np.zeros(12)
  first[np.asarray(acts.index)[0][np.asarray(acts.first)[0] > 0]] = 1
  np.testing.assert_array_equal(first, [0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0])


def test_a_loss_at_the_sampling_temperature_starts_its_ratios_at_one():
  tasks = LookupEnv.tasks("train", 2, 0)
  # Sampled at 2 (the same episodes: same weights, same seed). A loss at
  # temperature 2 trains the distribution sampled from; one at 1 reads the
  # sampler's temperature-1 log-probs and importance-weights the tokens
  # (TIS) by the temperature-2 ones they were drawn with. Either way the
  # trainer's forward agrees with the sampler.
  batches, weights = [], []
  for temperature, correction in ((1.0, "tis"), (2.0, "none")):
    trainer = _trainer({"temperature": 2.0}, {},
                       {"temperature": temperature, "is_correction": correction},
                       policy_temperature=temperature)
    m = trainer.iteration(tasks, 1, record=True)
    assert m["train/logprob_gap_max_abs"] < 1e-3 and m["train/skipped_updates"] == 0
    batches.append(trainer.recorded.batch)
    weights.append(m.get("train/tis_weight_mean"))
  tis, on_policy = batches
  np.testing.assert_array_equal(tis.tokens, on_policy.tokens)
  on = tis.loss_mask > 0
  assert np.abs(tis.old_logprobs[on] - on_policy.old_logprobs[on]).mean() > 0.05
  # Both record the temperature-2 log-probs the tokens were drawn with.
  np.testing.assert_allclose(tis.sampling_logprobs, on_policy.old_logprobs, atol=1e-5)
  np.testing.assert_allclose(on_policy.sampling_logprobs, on_policy.old_logprobs, atol=1e-5)
  # The weights exp(trainer - sampling) see the two temperatures' gap (their
  # mean under the sampling distribution is about 1).
  assert np.abs(tis.old_logprobs[on] - tis.sampling_logprobs[on]).mean() > 0.05
  assert 0.5 < weights[0] < 1.5 and weights[1] is None
  with pytest.raises(ValueError, match="policy_temperature=2.0"):
    _trainer({"temperature": 2.0}, {}, {"temperature": 2.0})


@pytest.mark.parametrize("rollout_kw, loss_kw, message", [
    ({"temperature": 1.3}, {}, "rollout.temperature=1.3 samples another distribution than "
     "the policy the loss trains (loss.temperature=1.0): set loss.temperature=1.3"),
    ({"temperature": 0.0}, {}, "rollout.temperature=0.0 samples another distribution"),
    ({"top_k": 4}, {}, "rollout.top_k=4, rollout.top_p=1.0 sample a filtered distribution"),
    ({"top_p": 0.9}, {"temperature": 1.0}, "rollout.top_k=0, rollout.top_p=0.9 sample a "
     "filtered distribution"),
])
def test_sampling_another_distribution_than_the_trained_policy_needs_tis(
    rollout_kw, loss_kw, message):
  with pytest.raises(ValueError, match=re.escape(message) + ".*loss.is_correction='tis'"):
    _trainer(rollout_kw, {}, loss_kw)
  _trainer(rollout_kw, {}, {**loss_kw, "is_correction": "tis"})  # corrected: runs


def test_a_filtered_sampler_warns_that_the_loss_trains_the_unfiltered_policy():
  for rollout_kw in ({"top_k": 4}, {"top_p": 0.9}):
    with pytest.warns(RuntimeWarning, match="loss trains the unfiltered policy"):
      _trainer(rollout_kw, {}, {"is_correction": "tis"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _trainer({"top_k": 0, "top_p": 1.0}, {})


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_prompt_that_does_not_fit_is_dropped_before_the_update(staleness):
  # The cache (128) is the largest bucket. The long task's prompt, its
  # observation cut to 256 tokens, fits neither: its episodes end at reset,
  # are counted and named, and the other task's group trains.
  tasks = [LookupEnv.tasks("train", 1, 0)[0], Task("long", "word " * 400, {"label": "left"})]
  trainer = _trainer({}, {"max_staleness": staleness},
                     {"is_correction": "tis"} if staleness else {})
  with pytest.warns(RuntimeWarning, match=re.escape(
      "1 task(s) have a prompt that leaves no room for rollout.min_action_tokens=1 in "
      "the 128-token context: ['long']; their episodes are dropped")):
    m = trainer.iteration(tasks, 1, upcoming=lambda j: None)
  trainer.close()
  assert m["rollout/ended/prompt_too_long"] == 2 and m["rollout/episodes"] == 2
  assert m["train/batch_tokens"] > 0 and m["train/skipped_updates"] == 0
  refusing = _trainer({"long_prompts": "error"}, {})
  with pytest.raises(ValueError, match=re.escape("128-token context: ['long'] "
                                                 "(rollout.long_prompts='error'")):
    refusing.iteration(tasks, 1)


def test_whitened_gae_advantages_reach_the_step():
  tasks = LookupEnv.tasks("train", 2, 0)
  trainer = _trainer({}, {"credit": "gae", "gamma": 0.9, "whiten_advantages": True},
                     {"value_coef": 0.5}, value_head=True)
  trainer.iteration(tasks, 1, record=True)
  batch = trainer.recorded.batch
  on = (batch.loss_mask > 0) & (batch.seq_ids >= 0)
  a = batch.advantages[on].astype(np.float64)
  assert abs(a.mean()) < 1e-5 and abs(a.std(ddof=1) - 1.0) < 1e-3
  assert np.all(batch.advantages[~on] == 0)
  with pytest.raises(ValueError, match="whiten_advantages cannot run with filter_zero_variance"):
    rl.RLConfig(whiten_advantages=True, filter_zero_variance=True)


def test_the_reset_observation_is_cut_like_any_other():
  engine = _trainer({"max_observation_tokens": 16}, {}).engine
  with pytest.warns(RuntimeWarning, match=re.escape(
      "1 task(s) have a reset observation longer than rollout.max_observation_tokens=16, "
      "cut with a marker: ['long']")):
    (traj, _) = engine.run([Task("long", "word " * 400, {"label": "left"})], 2).trajectories
  assert traj.metadata["prompt_cut"]
  prompt = engine.tok.decode(traj.segments[0].token_ids)
  assert "word word" in prompt and "...[truncated" in prompt and len(traj.segments[0]) < 100


def test_observation_loss_trains_on_observations_with_the_trainers_old_logprobs():
  tasks = LookupEnv.tasks("train", 2, 0)
  masked = _trainer({}, {}).iteration(tasks, 1)
  trainer = _trainer({}, {"observation_loss": True})
  m = trainer.iteration(tasks, 1, record=True)
  # The same episodes (same seed, same weights), more tokens in the loss.
  assert m["rollout/action_tokens_mean"] == masked["rollout/action_tokens_mean"]
  assert m["train/batch_tokens"] > masked["train/batch_tokens"] + 2 * m["rollout/episodes"]
  batch = trainer.recorded.batch
  actions_only = batch.replace(loss_mask=(batch.turn_index >= 0).astype(np.float32))
  np.testing.assert_array_equal(batch.loss_mask,
                                rl.observation_credit(actions_only)[0].loss_mask)
  # The added tokens' old log-probs are the trainer's, so the ratio starts
  # at 1 there: the rollout-vs-trainer gap stays what it is on actions
  # (old log-probs of 0 would put it at -log p of an observation token).
  assert m["train/logprob_gap_max_abs"] < 1e-3 and m["train/skipped_updates"] == 0
  # Their sampling log-probs too: TIS weighs them 1.
  added = (batch.loss_mask > 0) & (batch.turn_index < 0)
  assert added.any() and np.all(batch.old_logprobs[added] < 0)
  np.testing.assert_array_equal(batch.sampling_logprobs[added], batch.old_logprobs[added])
