"""Named algorithms are what their papers say (and what the ablation runs);
the ablation's intervals."""

import pathlib
import sys

import numpy as np
import pytest

from agentrl_jax import train
from agentrl_jax.train import presets, rl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
from configs import base  # noqa: E402  pylint: disable=wrong-import-position
import credit_ablation  # noqa: E402  pylint: disable=wrong-import-position


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
