"""Named algorithms are what their papers say (and what the ablation runs);
the ablation's intervals."""

import json
import pathlib
import subprocess
import sys

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


def test_ablation_arms_are_the_named_algorithms():
  for scheme in credit_ablation.SCHEMES:
    cfg = credit_ablation.config(scheme, 0, "tiny")
    assert cfg.algorithm == (scheme if scheme in presets.PRESETS else "")
    base.validate(cfg)
  assert "dapo" in credit_ablation.SCHEMES  # dynamic sampling is an arm
  cfg = presets.apply(credit_ablation.config("drgrpo", 0, "tiny"), "drgrpo")
  assert cfg.loss.agg == "seq-mean-token-sum-norm" and cfg.loss.norm_constant > 0


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


def test_a_preset_sets_defaults_and_explicit_flags_win():
  cfg = base.get_config()
  cfg.loss.clip_high, cfg.rl.credit = 0.3, "rloo"
  presets.apply(cfg, "grpo", keep={"loss.clip_high", "rollout.max_turns"})
  assert cfg.loss.clip_high == 0.3  # the flag's
  assert (cfg.rl.credit, cfg.loss.clip_low, cfg.loss.agg) == (
      "grpo", 0.2, "seq-mean-token-mean")  # the preset's
  kept = presets.kept_fields({"loss.clip_high", "rollout.max_turns"})
  assert kept == ["loss.clip_high"]
  assert presets.describe("grpo", cfg, overridden=kept).endswith(
      "overridden by flags: loss.clip_high=0.3")


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
  assert "overridden by flags: loss.clip_high=0.3" in out.stdout
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["loss"]["clip_high"] == 0.3
  assert (written["loss"]["clip_low"], written["loss"]["agg"]) == (0.2, "seq-mean-token-mean")
