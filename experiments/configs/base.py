"""Shared defaults of every experiment config (the tiny model, on a CPU).

Each `experiments/configs/<name>.py` starts from `get_config()` here and
changes what its environment or model needs. Every field can be overridden
from the command line: `--config.rl.group_size=16`. `validate(cfg)` checks a
resolved config before any work starts (train_agent calls it first).
"""

import dataclasses
import types
import typing

import ml_collections

from agentrl_jax import envs
from agentrl_jax.checks import FieldError
from agentrl_jax.models import LoraConfig
from agentrl_jax.rollout import RolloutConfig
from agentrl_jax.train import LossConfig, OptimConfig, presets
from agentrl_jax.train.rl import RLConfig, check_sections

# Config sections that are a library dataclass's fields.
SECTIONS = {"rollout": RolloutConfig, "optim": OptimConfig, "rl_optim": OptimConfig,
            "loss": LossConfig, "rl": RLConfig, "model.lora": LoraConfig}


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
  # GB of arrays a checkpoint writes at once (orbax's save_concurrent_gb, its
  # default here): bounds the host memory a save takes beyond the state;
  # above the largest array.
  c.checkpoint_write_gb = 96.0
  # GiB the train step may take (`agentrl_jax.train.memory`): before any
  # work, each step's estimate at its largest batch must fit, with more
  # micro-batches than configured where needed; 0: the machine's memory (the
  # device's, or the host's on a CPU); < 0: no estimate.
  c.memory_gb = 0.0
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
  # num_processes and this process's process_id. sampler_devices: the last k
  # devices sample alone (one host; the trainer's mesh takes the others), so
  # asynchronous rollouts (rl.max_staleness) run beside the step, not between.
  c.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=1, tensor=1, multihost=False, coordinator="", num_processes=1,
      process_id=0, sampler_devices=0))

  c.env = ml_collections.ConfigDict(dict(
      name="frozen_lake", kwargs={}, task_kwargs={}, chat_format="chatml",
      num_train_tasks=400, num_eval_tasks=64))
  # dtype: activations and the sampler's weights; param_dtype: the trained
  # masters and their AdamW moments (float32: under bf16 masters one 1e-6
  # AdamW step moved 1.7% of the tiny model's weights, 99.6% under float32). remat: recompute each
  # layer's activations in the backward pass (long rows of a large model).
  # lora.rank > 0: SFT and RL train LoRA adapters on the linears named in
  # lora.target_modules (and the value head), the base stays frozen.
  c.model = ml_collections.ConfigDict(dict(
      path="", tokenizer="", arch="llama", dtype="float32", param_dtype="float32",
      remat=False, tiny={}, lora=_section(LoraConfig),
      value_head=False))  # always True when the credit scheme needs values (gae)
  c.sampler = ml_collections.ConfigDict(dict(
      num_slots=64, cache_length=768, length_buckets=(32, 64, 128, 256),
      # Cache windows a decode may attend over (one program each); (): the
      # sampler's default S/4, S/2, S.
      attention_windows=()))
  # The sections below hold every field of their dataclass at its library
  # default (`_section`); what this CPU-sized run sets otherwise is named
  # in the call, so nothing else can drift from the library.
  c.rollout = _section(
      RolloutConfig, max_action_tokens=16, max_observation_tokens=128, env_workers=8,
      # Bit-reproducible runs on a CPU; accelerator configs turn the
      # tool/decode overlap back on (qwen_tpu.py).
      lockstep=True)
  # stop_at_success > 0 ends SFT (before `steps`) at the first check, every
  # check_every steps, where greedy success on check_tasks training-split
  # tasks after the demos' reaches it: every seed starts RL reading as well.
  # keep_failed: SFT on the expert's unsuccessful episodes too.
  # micro_batches: the batch split for exact gradient accumulation (more
  # where the memory budget needs them: memory_gb). SFT lays its rows out
  # as RL does (rl.buckets, rl.pack, rl.share_prompts).
  c.sft = ml_collections.ConfigDict(dict(num_demos=256, steps=150, batch_size=16,
                                         micro_batches=1,
                                         stop_at_success=0.0, check_every=25,
                                         check_tasks=32, keep_failed=False))
  c.optim = _section(OptimConfig, learning_rate=1e-3, total_steps=400, b2=0.99)
  # RL fine-tunes the SFT policy with its own, gentler optimiser.
  c.rl_optim = _section(OptimConfig, learning_rate=1e-4, warmup_steps=5, total_steps=200,
                        b2=0.99)
  c.loss = _section(LossConfig)
  # DAPO's dynamic sampling refill and overlong shaping, partial rollouts
  # (token_budget): see agentrl_jax/train/rl.py. Buckets up to the cache.
  c.rl = _section(RLConfig, buckets=(128, 256, 512, 768))
  return c


class ConfigError(ValueError):
  """A config no run could use."""


def _section(cls, **overrides) -> ml_collections.ConfigDict:
  """Every field of dataclass `cls` at its default, then `overrides`. A field
  that may be None is a typed FieldReference, so a flag can still set it."""
  unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
  if unknown:
    raise KeyError(f"{cls.__name__} has no fields {sorted(unknown)}")
  hints = typing.get_type_hints(cls)
  section = {}
  for f in dataclasses.fields(cls):
    value = overrides.get(f.name, f.default)
    optional = typing.get_origin(hints[f.name]) in (typing.Union, types.UnionType)
    if optional:
      inner, = (t for t in typing.get_args(hints[f.name]) if t is not type(None))
      value = ml_collections.FieldReference(value, field_type=inner)
    section[f.name] = value
  return ml_collections.ConfigDict(section)


def validate(cfg) -> None:
  """Raises ConfigError naming each field no run could use: the library
  dataclasses' own rules (each section built once here), the RL section's
  rules against the others (`rl.check_sections`, which RLTrainer also
  applies), then what spans sections here (buckets against the cache, the
  mesh against the batch)."""
  bad = []
  built = {}
  for name, cls in SECTIONS.items():
    try:
      built[name] = cls(**cfg[name])
    except FieldError as e:
      bad += [f"{name}.{field} = {value!r} {why}" for field, value, why in e.problems]
    except (TypeError, ValueError) as e:
      bad.append(f"{name}: {e}")
  if "rl" in built and "loss" in built:
    try:
      check_sections(built["rl"], built["loss"], cfg.sampler.cache_length,
                     built.get("rollout"))
    except ValueError as e:
      bad.append(f"rl: {e}")
  split = cfg.mesh.data * cfg.mesh.fsdp
  env_problem = _env_problem(cfg.env.name)
  rules = [
      ("iterations", cfg.iterations >= 0, "must be >= 0"),
      ("eval_every", cfg.eval_every >= 1, "must be >= 1"),
      ("checkpoint_every", cfg.checkpoint_every >= 1, "must be >= 1"),
      ("checkpoint_write_gb", cfg.checkpoint_write_gb > 0, "must be > 0"),
      ("eval_samples", cfg.eval_samples >= 0, "must be >= 0"),
      ("sft.steps", cfg.sft.steps >= 0, "must be >= 0"),
      ("sft.batch_size", cfg.sft.batch_size >= 1, "must be >= 1"),
      ("sft.micro_batches", cfg.sft.micro_batches >= 1
       and cfg.sft.batch_size % cfg.sft.micro_batches == 0, "must be >= 1 and divide "
       f"sft.batch_size ({cfg.sft.batch_size})"),
      ("sft.stop_at_success", 0.0 <= cfg.sft.stop_at_success <= 1.0, "must be in [0, 1]"),
      ("sft.check_every", cfg.sft.check_every >= 1, "must be >= 1"),
      ("sft.check_tasks", cfg.sft.check_tasks >= 1 and (
          not cfg.sft.stop_at_success
          or cfg.sft.num_demos + cfg.sft.check_tasks <= cfg.env.num_train_tasks),
       f"must be >= 1 and fit after sft.num_demos in env.num_train_tasks "
       f"({cfg.env.num_train_tasks})"),
      ("sampler.num_slots", cfg.sampler.num_slots >= 1, "must be >= 1"),
      ("mesh.sampler_devices", cfg.mesh.sampler_devices >= 0
       and not (cfg.mesh.sampler_devices and cfg.mesh.multihost),
       "must be >= 0, and 0 with mesh.multihost (each host samples on its own devices)"),
      ("algorithm", cfg.algorithm in ("", *presets.PRESETS),
       f"must be one of {('', *presets.PRESETS)}"),
      ("env.name", env_problem is None, f"does not load: {env_problem}"),
  ]
  if split > 1:
    rows = cfg.rl.tasks_per_iteration * cfg.rl.group_size
    rules += [(what, n % split == 0, f"must divide by mesh data x fsdp = {split}")
              for what, n in (("rl.tasks_per_iteration x rl.group_size", rows),
                              ("sft.batch_size", cfg.sft.batch_size),
                              ("sampler.num_slots", cfg.sampler.num_slots))]
    if cfg.rl.pack:
      rules.append(("rl.pack_row_multiple", (cfg.rl.pack_row_multiple * cfg.mesh.num_processes)
                    % split == 0, f"x mesh.num_processes must divide by mesh data x fsdp = "
                    f"{split} when rl.pack"))
  bad += [f"{name} = {_value(cfg, name)!r} {why}" for name, ok, why in rules if not ok]
  if bad:
    raise ConfigError("invalid config: " + "; ".join(bad))


def _env_problem(env_name: str) -> str | None:
  """Why `env_name` names no environment, or None."""
  try:
    envs.env_class(env_name)
  except ValueError as e:
    return str(e)
  return None


def _value(cfg, name: str):
  if " x " in name:  # a product of fields
    a, b = name.split(" x ")
    return _value(cfg, a) * _value(cfg, b)
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
