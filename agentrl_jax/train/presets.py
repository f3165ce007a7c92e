"""Named algorithms: what "GRPO", "Dr.GRPO" or "DAPO" mean, in one place.

An algorithm is more than its advantage estimator: the loss aggregation,
the normaliser and the filtering change what it optimises. A preset fixes
all four, as its paper does, so an ablation arm named "drgrpo" is Dr.GRPO
and not GRPO without the std:

  grpo    group-relative advantages with the population std (the reference
          text's choice; TRL and veRL use the unbiased one, sqrt(G / (G-1))
          larger), seq-mean-token-mean (every trajectory weighs the same),
          no filtering. Shao et al. 2024 (DeepSeekMath), eq. 3.
  drgrpo  r - mean, no std; seq-mean-token-sum-norm with a fixed constant,
          the episode's token budget (max_turns x max_action_tokens), so no
          length-dependent scaling remains. Liu et al. 2025 ("Understanding
          R1-Zero-like training"), sec. 3.
  dapo    group-relative with the std; token-mean (every token weighs the
          same); groups without signal dropped and refilled from extra
          rollouts (dynamic sampling, at most 2 x tasks_per_iteration extra
          tasks); clip-higher (0.2 / 0.28). Yu et al. 2025. Its overlong
          shaping depends on a run's token budget: `rl.overlong_buffer`.

`apply(cfg, name, keep=...)` writes a preset into an experiment config
(`cfg.rl`, `cfg.loss`) as defaults: fields in `keep` (what the command line
set) stay as they are; `describe(name)` prints it, what a flag overrode and
(with `changes`) which of the config's own values it replaced.
Every preset leaves `loss.kl_beta` at the config's 0 (DeepSeekMath's GRPO
used a KL weight of 0.04; veRL's GRPO examples 0.001; DAPO and Dr.GRPO
drop the KL term): set it with a flag.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Preset:
  credit: str  # advantage estimator (a registered `credit` scheme)
  agg: str  # loss aggregation mode (`losses.LOSS_AGG_MODES`)
  norm: str | None  # "token_budget": C = max_turns x max_action_tokens; None: no C
  filter_zero_variance: bool
  refill: int  # max_refill_tasks = refill x tasks_per_iteration
  clip: tuple[float, float]  # (clip_low, clip_high)
  source: str


PRESETS = {
    "grpo": Preset("grpo", "seq-mean-token-mean", None, False, 0, (0.2, 0.2),
                   "Shao et al. 2024; population std"),
    "drgrpo": Preset("drgrpo", "seq-mean-token-sum-norm", "token_budget", False, 0,
                     (0.2, 0.2),
                     "Liu et al. 2025; no std, fixed normaliser"),
    "dapo": Preset("grpo", "token-mean", None, True, 2, (0.2, 0.28),
                   "Yu et al. 2025; dynamic sampling"),
}


def _get(name: str) -> Preset:
  if name not in PRESETS:
    raise ValueError(f"unknown algorithm preset {name!r}; known: {tuple(PRESETS)}")
  return PRESETS[name]


def norm_constant(name: str, cfg) -> float | None:
  """The preset's fixed normaliser C for this config (None if it has none)."""
  if _get(name).norm is None:
    return None
  return float(cfg.rollout.max_turns * cfg.rollout.max_action_tokens)


def settings(name: str, cfg) -> dict[str, object]:
  """The config fields the preset sets ("loss.agg": ...) and their values."""
  p = _get(name)
  return dict(zip(FIELDS, (
      p.credit, p.filter_zero_variance, p.refill * cfg.rl.tasks_per_iteration, p.agg,
      norm_constant(name, cfg), p.clip[0], p.clip[1])))


FIELDS = ("rl.credit", "rl.filter_zero_variance", "rl.max_refill_tasks", "loss.agg",
          "loss.norm_constant", "loss.clip_low", "loss.clip_high")


def kept_fields(keep) -> list[str]:
  """The preset fields among `keep`, in `FIELDS` order."""
  return [f for f in FIELDS if f in set(keep)]


def changes(cfg, name: str, *, keep=()) -> dict[str, tuple[object, object]]:
  """What `apply(cfg, name, keep=keep)` would change: {field: (cfg's value,
  the preset's)}, e.g. a config file's own `rl.credit` the preset replaces."""
  out = {}
  for field, value in settings(name, cfg).items():
    section, leaf = field.split(".")
    if field not in keep and cfg[section][leaf] != value:
      out[field] = (cfg[section][leaf], value)
  return out


def apply(cfg, name: str, *, keep=()):
  """Sets credit, aggregation, normaliser, filtering and clipping, except the
  fields named in `keep` (set by flags: an explicit flag wins); returns cfg."""
  for field, (_, value) in changes(cfg, name, keep=keep).items():
    section, leaf = field.split(".")
    cfg[section][leaf] = value
  return cfg


def describe(name: str, cfg=None, overridden=(), replaced=None) -> str:
  """One line per setting, e.g. for a notebook cell or a run's log;
  `overridden`: the fields a flag set instead (shown with cfg's values);
  `replaced`: `changes`' result, the config's values the preset replaced."""
  p = _get(name)
  c = norm_constant(name, cfg) if cfg is not None else p.norm
  line = (f"{name}: advantages={p.credit}, aggregation={p.agg}, normaliser C={c}, "
          f"filter_zero_variance={p.filter_zero_variance}, "
          f"refill={p.refill} x tasks_per_iteration, clip={p.clip} ({p.source})")
  if overridden:
    flags = ", ".join(f"{f}={cfg[f.split('.')[0]][f.split('.')[1]]!r}" for f in overridden)
    line += f"; overridden by flags: {flags}"
  if replaced:
    line += "; replaced in the config: " + ", ".join(
        f"{f} {old!r} -> {new!r}" for f, (old, new) in replaced.items())
  return line
