"""Shared defaults of every experiment config (the tiny model, on a CPU).

Each `experiments/configs/<name>.py` starts from `get_config()` here and
changes what its environment or model needs. Every field can be overridden
from the command line: `--config.rl.group_size=16`. `validate(cfg)` checks a
resolved config before any work starts (train_agent calls it first).
"""

import ml_collections

from agentrl_jax import envs, losses
from agentrl_jax.train import credit, presets, step


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  # A named algorithm (agentrl_jax.train.presets: grpo, drgrpo, dapo) sets
  # rl.credit, loss.agg, loss.norm_constant, rl.filter_zero_variance and the
  # clip range as its paper does; "" keeps the fields below as they are.
  c.algorithm = ""
  c.iterations = 60
  c.eval_every = 10  # greedy held-out success every k iterations
  # Also after SFT and at the end: success at temperature 1 (what RL
  # optimises), this many episodes per held-out task; 0 skips it.
  c.eval_samples = 4
  c.checkpoint_every = 20
  c.keep_checkpoints = 2
  # Episodes for the trajectory viewer (experiments/view.py), written to
  # <workdir>/trajectories.jsonl: every k RL iterations (0: never) up to
  # `per_group` of each group (its best and worst first), and at every
  # greedy evaluation the first `eval_episodes` held-out episodes.
  c.log = ml_collections.ConfigDict(dict(trajectories_every=10, per_group=2,
                                         eval_episodes=8))
  # ((first iteration, allowed task levels), ...); empty: all levels always.
  c.curriculum = ()

  # Device mesh (agentrl_jax.sharding): data x fsdp x tensor must equal the
  # device count (of all hosts); all 1 runs on one device without a mesh.
  # multihost: one process per host (agentrl_jax.distributed); an empty
  # coordinator lets jax.distributed.initialize() find everything itself
  # (TPU VM slices, SLURM, ...), else "host:port" of process 0 with
  # num_processes and this process's process_id.
  c.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=1, tensor=1, multihost=False, coordinator="", num_processes=1,
      process_id=0))

  c.env = ml_collections.ConfigDict(dict(
      name="frozen_lake", kwargs={}, task_kwargs={}, chat_format="chatml",
      num_train_tasks=400, num_eval_tasks=64))
  c.model = ml_collections.ConfigDict(dict(
      path="", tokenizer="", arch="llama", dtype="float32", tiny={},
      value_head=False))  # always True when the credit scheme needs values (gae)
  c.sampler = ml_collections.ConfigDict(dict(
      num_slots=64, cache_length=768, length_buckets=(32, 64, 128, 256),
      # Cache windows a decode may attend over (one program each); (): the
      # sampler's default S/4, S/2, S.
      attention_windows=()))
  c.rollout = ml_collections.ConfigDict(dict(
      max_turns=8, max_action_tokens=16, max_observation_tokens=128,
      temperature=1.0, top_k=0, top_p=1.0, env_workers=8, lockstep=True,
      system_prompt=ml_collections.FieldReference(None, field_type=str),
      # Sliding-window context (keep the last k turns); None: append-only.
      context_window=ml_collections.FieldReference(None, field_type=int)))
  c.sft = ml_collections.ConfigDict(dict(num_demos=256, steps=150, batch_size=16))
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-3, warmup_steps=10, total_steps=400, end_lr_fraction=0.1,
      weight_decay=0.0, b1=0.9, b2=0.99, clip_norm=1.0))
  # RL fine-tunes the SFT policy with its own, gentler optimiser.
  c.rl_optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-4, warmup_steps=5, total_steps=200, end_lr_fraction=0.1,
      weight_decay=0.0, b1=0.9, b2=0.99, clip_norm=1.0))
  c.loss = ml_collections.ConfigDict(dict(
      clip_low=0.2, clip_high=0.28, dual_clip=None, agg="token-mean",
      norm_constant=None, kl_beta=0.0, kl_kind="k3", entropy_coef=0.0,
      value_coef=0.0, is_correction="none", tis_cap=2.0, ppo_epochs=1,
      micro_batches=1, behaviour_forward=True, head_chunk=1024))
  c.rl = ml_collections.ConfigDict(dict(
      group_size=8, tasks_per_iteration=8, credit="grpo", gamma=1.0, lam=0.95,
      filter_zero_variance=False, branch_size=2, buckets=(128, 256, 512, 768),
      max_bad_steps=5, fork_branches=True,
      # DAPO: dynamic sampling's cap of extra tasks (needs filter_zero_variance)
      # and overlong shaping (see agentrl_jax/train/rl.py).
      max_refill_tasks=0, overlong_buffer=0, overlong_penalty=1.0, mask_truncated=False,
      # Partial rollouts: sampled tokens per iteration; None: episodes finish.
      token_budget=ml_collections.FieldReference(None, field_type=int)))
  return c


class ConfigError(ValueError):
  """A config no run could use."""


def validate(cfg) -> None:
  """Raises ConfigError naming each field no run could use."""
  env_problem = _env_problem(cfg.env.name)
  rules = [
      ("iterations", cfg.iterations >= 0, "must be >= 0"),
      ("eval_every", cfg.eval_every >= 1, "must be >= 1"),
      ("checkpoint_every", cfg.checkpoint_every >= 1, "must be >= 1"),
      ("eval_samples", cfg.eval_samples >= 0, "must be >= 0"),
      ("optim.learning_rate", cfg.optim.learning_rate > 0, "must be > 0"),
      ("rl_optim.learning_rate", cfg.rl_optim.learning_rate > 0, "must be > 0"),
      ("sft.steps", cfg.sft.steps >= 0, "must be >= 0"),
      ("sft.batch_size", cfg.sft.batch_size >= 1, "must be >= 1"),
      ("sampler.num_slots", cfg.sampler.num_slots >= 1, "must be >= 1"),
      ("rl.group_size", cfg.rl.group_size >= 1, "must be >= 1"),
      ("rl.tasks_per_iteration", cfg.rl.tasks_per_iteration >= 1, "must be >= 1"),
      ("rollout.max_turns", cfg.rollout.max_turns >= 1, "must be >= 1"),
      ("rollout.env_workers", cfg.rollout.env_workers >= 1, "must be >= 1"),
      ("rl.credit", cfg.rl.credit in credit.schemes(),
       f"must be one of {credit.schemes()} (or a scheme registered with "
       "credit.register before the config is read)"),
      ("algorithm", cfg.algorithm in ("", *presets.PRESETS),
       f"must be one of {('', *presets.PRESETS)}"),
      ("loss.agg", cfg.loss.agg in losses.LOSS_AGG_MODES,
       f"must be one of {losses.LOSS_AGG_MODES}"),
      ("loss.kl_kind", cfg.loss.kl_kind in losses.KL_KINDS,
       f"must be one of {losses.KL_KINDS}"),
      ("loss.is_correction", cfg.loss.is_correction in step.IS_CORRECTIONS,
       f"must be one of {step.IS_CORRECTIONS}"),
      ("env.name", env_problem is None, f"does not load: {env_problem}"),
  ]
  bad = [f"{name} = {_get(cfg, name)!r} {why}" for name, ok, why in rules if not ok]
  if bad:
    raise ConfigError("invalid config: " + "; ".join(bad))


def _env_problem(env_name: str) -> str | None:
  """Why `env_name` names no environment, or None."""
  try:
    envs.env_class(env_name)
  except ValueError as e:
    return str(e)
  return None


def _get(cfg, name: str):
  for part in name.split("."):
    cfg = cfg[part]
  return cfg


def unknown_field(cfg, overrides) -> str | None:
  """The first `--config.a.b=...` override naming a field `cfg` lacks, as a
  message listing the fields there are; None if every one exists."""
  for arg in overrides:
    if not arg.startswith("--config."):
      continue
    node, path = cfg, arg[len("--config."):].split("=")[0].split(".")
    for depth, part in enumerate(path):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        where = ".".join(["config", *path[:depth]])
        known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        return f"{arg}: {where} has no field {part!r}; its fields: {', '.join(known)}"
      node = node[part]
  return None
