"""Named algorithms are what their papers say (and what the ablation runs);
the ablation's intervals."""

import itertools
import json
import pathlib
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest

from agentrl_jax import train
from agentrl_jax.train import presets, rl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
from configs import base  # noqa: E402  pylint: disable=wrong-import-position
import credit_ablation  # noqa: E402  pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_presets_set_estimator_aggregation_normaliser_filtering():
  cfg = presets.apply(base.get_config(), "grpo")
  assert (cfg.rl.credit, cfg.loss.agg, cfg.loss.norm_constant) == (
      "grpo", "seq-mean-token-mean", None)
  assert not cfg.rl.filter_zero_variance and cfg.loss.clip_high == 0.2
  cfg = presets.apply(base.get_config(), "drgrpo")
  # C = the episode's token budget: 8 turns x 16 action tokens.
  assert (cfg.rl.credit, cfg.loss.agg, cfg.loss.norm_constant) == (
      "drgrpo", "seq-mean-token-sum-norm", 128.0)
  cfg = presets.apply(base.get_config(), "dapo")
  assert (cfg.rl.credit, cfg.loss.agg, cfg.rl.filter_zero_variance, cfg.loss.clip_high) == (
      "grpo", "token-mean", True, 0.28)
  for name in presets.PRESETS:  # every preset builds a valid step and loop config
    cfg = presets.apply(base.get_config(), name)
    train.LossConfig(**cfg.loss)
    rl.RLConfig(**cfg.rl)
  assert "seq-mean-token-sum-norm" in presets.describe("drgrpo")
  assert "C=128.0" in presets.describe("drgrpo", base.get_config())
  with pytest.raises(ValueError, match="known: \\('grpo', 'drgrpo', 'dapo'\\)"):
    presets.apply(base.get_config(), "ppo2")


def test_ablation_arms_change_one_thing_against_grpo():
  grpo = credit_ablation.config("grpo", 0, "tiny")
  loss_fields = ("agg", "norm_constant", "clip_low", "clip_high")
  for env in credit_ablation.ENVS:
    for size, name in itertools.product(credit_ablation.SIZES[env],
                                        (*credit_ablation.ARM_NAMES, *credit_ablation.VARIANTS)):
      cfg = credit_ablation.config(name, 0, size, env)
      base.validate(cfg)
      if env == "sokoban":  # the expert's demos fit the turn budget
        assert cfg.rollout.max_turns >= cfg.env.task_kwargs["min_moves"] + 6
      if env == "tools":  # the warehouse task in Qwen2.5's tool-call format
        assert cfg.env.name.endswith("warehouse_tools.py:make_env")
        assert (cfg.env.chat_format, cfg.model.tiny.vocab_size) == ("qwen2.5", 1024)
      comparison = credit_ablation.arm(name).comparison
      if comparison in ("baseline", "estimator", "masking"):
        # grpo's whole loss; only the estimator or the loss mask differs.
        assert cfg.algorithm == "grpo" and not cfg.rl.filter_zero_variance
        assert [cfg.loss[f] for f in loss_fields] == [
            "seq-mean-token-mean", None, 0.2, 0.2], (env, name)
        assert cfg.rl.observation_loss == (name == "obs_loss")
        assert cfg.rl.credit == (name.removesuffix("_detached") if comparison == "estimator"
                                 else "grpo")
        assert cfg.loss.value_detach == (name == "gae_detached")
      else:  # a named algorithm: its preset, whole
        assert cfg.algorithm == name and cfg.rl.credit == presets.PRESETS[name].credit
      # What train_agent re-applies (the preset, keeping the arm's fields)
      # changes nothing.
      again = presets.apply(credit_ablation.config(name, 0, size, env), cfg.algorithm,
                            keep=credit_ablation.arm_fields(name))
      assert again.to_dict() == cfg.to_dict()
  assert credit_ablation.config("gae", 0, "tiny").loss.value_coef == 0.5
  assert credit_ablation.config("gae_detached", 0, "tiny").loss.value_coef == 0.5
  assert "gae_detached" not in credit_ablation.ARM_NAMES  # run when named only
  assert credit_ablation.config("drgrpo", 0, "tiny").loss.agg == "seq-mean-token-sum-norm"
  assert credit_ablation.config("dapo", 0, "tiny").rl.max_refill_tasks == 2 * 2
  assert grpo.rl.credit == "grpo" and grpo.env.name == "frozen_lake"
  assert credit_ablation.config("turn_grpo", 0, "tiny").rl.credit == "turn_grpo"  # registered
  with pytest.raises(ValueError, match="unknown arm 'nope'"):
    credit_ablation.config("nope", 0, "tiny")
  misspelt = {"frozen_lake": {"tiny": dict(seeds=(0,), overrides={"loss.ppo_epoch": 1})}}
  with mock.patch.dict(credit_ablation.SIZES, misspelt), pytest.raises(
      ValueError, match="frozen_lake tiny: no config field 'loss.ppo_epoch'"):
    credit_ablation.config("grpo", 0, "tiny")


def test_bootstrap_interval_of_the_mean_over_seeds():
  # Many seeds: the percentile interval is the normal one, mean +- 1.96 x
  # the standard error (population std / sqrt(n)), within 5%.
  rng = np.random.default_rng(0)
  values = rng.normal(0.6, 0.1, (400, 3))
  mean, low, high = credit_ablation.bootstrap_mean(values)
  np.testing.assert_allclose(mean, values.mean(0))
  half = 1.96 * values.std(0) / np.sqrt(400)
  np.testing.assert_allclose(high - mean, half, rtol=0.05)
  np.testing.assert_allclose(mean - low, half, rtol=0.05)
  # Identical seeds: no spread to resample. A paired difference of 8 seeds
  # all of one sign excludes 0; one of mixed signs around 0 does not.
  assert credit_ablation.bootstrap_mean([0.5] * 8)[1:] == (0.5, 0.5)
  _, low, _ = credit_ablation.bootstrap_mean([0.02, 0.05, 0.01, 0.08, 0.03, 0.04, 0.06, 0.02])
  assert low > 0
  _, low, high = credit_ablation.bootstrap_mean([0.05, -0.04, 0.02, -0.06, 0.01, 0.03, -0.02, 0.0])
  assert low < 0 < high


def test_interval_table_pairs_arms_with_grpo_on_each_seed(tmp_path):
  # Hand-made runs of 3 arms on 3 seeds: greedy success from the metric
  # rows (step 0 is the shared SFT start), T = 1 and pass@4 from summary.json.
  greedy = {"grpo": [0.5, 0.6, 0.7], "gigpo": [0.6, 0.7, 0.8], "obs_loss": [0.4, 0.7, 0.6]}
  results = {}
  for name, values in greedy.items():
    for seed, g in enumerate(values):
      results[name, seed] = [{"step": 0, "eval/success": 0.3 + seed / 10},
                             {"step": 30, "eval/success": g}]
      for run in (name, "sft"):
        (tmp_path / run / f"seed{seed}").mkdir(parents=True, exist_ok=True)
      (tmp_path / name / f"seed{seed}" / "summary.json").write_text(json.dumps(
          {"rl_success_sampled": g - 0.1, "rl_pass_at_4": g + 0.1}))
      (tmp_path / "sft" / f"seed{seed}" / "summary.json").write_text(json.dumps(
          {"sft_success_sampled": 0.2, "sft_pass_at_4": 0.5}))
  rows = {r["arm"]: r for r in credit_ablation.interval_table(
      tmp_path, results, pass_key="pass_at_4")}
  assert [r["comparison"] for r in rows.values()] == ["start", "baseline", "estimator",
                                                       "masking"]
  np.testing.assert_allclose(rows["sft"]["greedy"][0], 0.4)
  np.testing.assert_allclose(rows["grpo"]["pass"][0], 0.7)
  # gigpo is grpo + 0.1 on every seed: the paired interval is that, exactly.
  for kind in ("greedy", "t1", "pass"):
    np.testing.assert_allclose(rows["gigpo"][f"{kind}_diff"], [0.1, 0.1, 0.1])
    assert rows["gigpo"][f"{kind}_distinct"]
  # obs_loss: -0.1, +0.1, -0.1 on the seeds: the interval holds 0.
  diff = rows["obs_loss"]["greedy_diff"]
  np.testing.assert_allclose(diff[0], -0.1 / 3)
  assert diff[1] < 0 < diff[2] and not rows["obs_loss"]["greedy_distinct"]
  assert "grpo_diff" not in rows["grpo"] and "greedy_diff" not in rows["grpo"]
  text = credit_ablation.format_table(list(rows.values()))
  assert "+0.100 [+0.100, +0.100]*" in text and "pass@k - grpo" in text


def test_summary_windows_of_rollout_success_never_overlap():
  # Rollout success k / 100 at iteration k: 15 iterations compare 1-5 with
  # 11-15, 30 iterations 1-10 with 21-30.
  def runs(n):
    return {("grpo", 0): [{"step": 0, "eval/success": 0.2}] + [
        {"step": k, "rollout/success_frac": k / 100, "eval/success": 0.3} for k in
        range(1, n + 1)]}
  (short,), (long_,) = (credit_ablation.summary_table(runs(n)) for n in (15, 30))
  np.testing.assert_allclose([short["rollout_first"], short["rollout_last"]], [0.03, 0.13])
  np.testing.assert_allclose([long_["rollout_first"], long_["rollout_last"]], [0.055, 0.255])
  assert short["sft_success"] == 0.2 and short["final_success"] == 0.3


def test_a_preset_sets_defaults_and_explicit_flags_win():
  cfg = base.get_config()
  cfg.loss.clip_high, cfg.rl.credit = 0.3, "rloo"
  # What the preset replaces: the config's own estimator and the base's
  # token-mean; not the flag's clip, nor clip_low (already the preset's 0.2).
  replaced = presets.changes(cfg, "grpo", keep={"loss.clip_high", "rollout.max_turns"})
  assert replaced == {"rl.credit": ("rloo", "grpo"),
                      "loss.agg": ("token-mean", "seq-mean-token-mean")}
  presets.apply(cfg, "grpo", keep={"loss.clip_high", "rollout.max_turns"})
  assert presets.changes(cfg, "grpo") == {"loss.clip_high": (0.3, 0.2)}
  assert cfg.loss.clip_high == 0.3  # the flag's
  assert (cfg.rl.credit, cfg.loss.clip_low, cfg.loss.agg) == (
      "grpo", 0.2, "seq-mean-token-mean")  # the preset's
  kept = presets.kept_fields({"loss.clip_high", "rollout.max_turns"})
  assert kept == ["loss.clip_high"]
  assert presets.describe("grpo", cfg, overridden=kept).endswith(
      "overridden by flags: loss.clip_high=0.3")
  assert presets.describe("grpo", cfg, overridden=kept, replaced=replaced).endswith(
      "overridden by flags: loss.clip_high=0.3; replaced in the config: rl.credit 'rloo' "
      "-> 'grpo', loss.agg 'token-mean' -> 'seq-mean-token-mean'")


def test_the_command_line_preset_keeps_explicit_flags(tmp_path):
  # --config.algorithm sets defaults under the flags: the resolved
  # config.json holds the flag's clip and the preset's aggregation. (The run
  # then stops at the missing model, after writing it.)
  out = subprocess.run(
      [sys.executable, "experiments/train_agent.py", f"--workdir={tmp_path}",
       "--config=experiments/configs/default.py", "--config.algorithm=grpo",
       "--config.loss.clip_high=0.3", f"--config.model.path={tmp_path}/no_model"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert "no_model has no config.json" in out.stderr
  assert "overridden by flags: loss.clip_high=0.3; replaced in the config: " in out.stdout
  assert "loss.agg 'token-mean' -> 'seq-mean-token-mean'" in out.stdout
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["loss"]["clip_high"] == 0.3
  assert (written["loss"]["clip_low"], written["loss"]["agg"]) == (0.2, "seq-mean-token-mean")


def test_the_ablation_loads_a_lora_run_saved_with_and_without_its_kl_reference(tmp_path):
  import jax  # pylint: disable=import-outside-toplevel
  from agentrl_jax import checkpointing  # pylint: disable=import-outside-toplevel
  cfg = credit_ablation.config("grpo", 0, "tiny")
  cfg.model.lora.rank = 2
  policy = credit_ablation._Policy(cfg)  # pylint: disable=protected-access
  tx = train.make_optimizer(train.OptimConfig(**cfg.rl_optim))
  _, state = train.init_train_state(policy.model, tx, with_reference=True)
  # As an ablation saves them: the shared SFT start without a KL reference
  # (grpo's kl_beta 0), an arm's RL step with one (kl_beta > 0); trained
  # adapters (B off its zero start).
  states = {0: state.replace(params=jax.tree.map(lambda x: x + 0.01, state.params),
                             ref_params=None),
            3: state.replace(params=jax.tree.map(lambda x: x - 0.02, state.params))}
  with checkpointing.Checkpointer(tmp_path / "checkpoints") as ckpt:
    for step, saved in states.items():
      ckpt.save(step, train.checkpointed(saved), {})
  for step, saved in ((0, states[0]), (None, states[3])):  # None: the latest
    loaded = policy.load(tmp_path, step)
    want = jax.tree.leaves(saved.model_params)
    assert len(jax.tree.leaves(loaded)) == len(want) > len(jax.tree.leaves(state.params))
    for got, expected, sampled in zip(jax.tree.leaves(loaded), want,
                                      jax.tree.leaves(policy.sampler.params)):
      np.testing.assert_array_equal(got, expected)
      np.testing.assert_array_equal(sampled, expected)
