"""Every experiment config resolves and builds its model, sampler, engine and tasks."""

import json
import math
import pathlib
import re
import subprocess
import sys

from flax import nnx
import jax
import pytest

from agentrl_jax import models
from agentrl_jax.train import credit, rl
from agentrl_jax import tokenizer as T
from agentrl_jax import tools

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "tests"))
from configs import (base, calculator, default,  # pylint: disable=wrong-import-position
                     frozen_lake_6x6, frozen_lake_turn_credit, python_tool, qwen_tpu,
                     search_qa, smollm2_calculator, sokoban, tools_example)
import train_agent  # pylint: disable=wrong-import-position

CONFIGS = {
    "default": default.get_config, "default:plain": lambda: default.get_config("plain"),
    "calculator": calculator.get_config,
    "search_qa": search_qa.get_config, "python_tool": python_tool.get_config,
    "tools_example": tools_example.get_config,
    "sokoban:gigpo": lambda: sokoban.get_config("gigpo"),
    "frozen_lake_6x6:gigpo": lambda: frozen_lake_6x6.get_config("gigpo"),
    **{f"frozen_lake_turn_credit:{s}": (lambda s=s: frozen_lake_turn_credit.get_config(s))
       for s in ("turn_returns", "turn_grpo", "gae", "branching", "gigpo")},
}


def test_default_is_the_door_task_over_plain_frozen_lake():
  door, plain = default.get_config(), default.get_config("plain")
  # Demonstrations to either exit, all kept; G the only exit in plain.
  assert door.env.task_kwargs["decoy"] and door.env.kwargs["demo_exits"] == "either"
  assert door.sft.keep_failed and not plain.sft.keep_failed
  assert "decoy" not in plain.env.task_kwargs and not plain.env.kwargs
  assert plain.to_dict() == default.frozen_lake().to_dict()
  with pytest.raises(ValueError, match="unknown task 'doors'"):
    default.get_config("doors")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_builds(name):
  cfg = CONFIGS[name]()
  base.validate(cfg)
  cfg.env.num_train_tasks, cfg.env.num_eval_tasks = 8, 4
  model, sampler, engine, train_tasks, eval_tasks = train_agent.build(cfg)
  assert len(train_tasks) == 8 and len(eval_tasks) == 4
  assert not {t.task_id for t in train_tasks} & {t.task_id for t in eval_tasks}
  assert model.cfg.value_head == (cfg.rl.credit == "gae")
  assert sampler.cache_length == cfg.sampler.cache_length
  s = cfg.sampler.cache_length
  assert sampler.attention_windows == (tuple(cfg.sampler.attention_windows)
                                       or (s // 4, s // 2, s))
  engine.close()


def test_qwen_config_trains_end_to_end_with_the_real_vocabulary(tmp_path, qwen_tokenizer,
                                                                monkeypatch):
  """A reduced-depth random Qwen2 with the real 151,665-token vocabulary and
  the Qwen2.5 tokenizer stands in for Qwen2.5-0.5B-Instruct: the Qwen config
  loads both from the checkpoint directory and runs RL on search_qa with a
  JSON search tool in Qwen2.5's own format. Without SFT, RL starts from the
  state built for it: no second set of moments or reference is made (the
  freed first set stays in the host heap: +3.6 GiB of RSS at 0.5B)."""
  vocab = len(qwen_tokenizer)
  assert vocab == 151_665
  models.save_pretrained(models.Decoder(
      models.tiny_config("qwen2", vocab_size=vocab, num_layers=1, hidden_size=64,
                         intermediate_size=128, head_dim=16), rngs=nnx.Rngs(0)),
      tmp_path / "ckpt")
  qwen_tokenizer.save_pretrained(tmp_path / "ckpt")
  cfg = qwen_tpu.get_config(str(tmp_path / "ckpt"))
  # Reduced sizes only: model, tokenizer, chat format, env and dtype are the config's.
  for key, value in {"iterations": 2, "eval_every": 100, "eval_samples": 0,
                     "env.num_train_tasks": 8, "env.num_eval_tasks": 2,
                     "rl.tasks_per_iteration": 2, "rl.group_size": 2,
                     "rollout.max_turns": 2, "rollout.max_action_tokens": 12,
                     "sampler.num_slots": 4, "sampler.cache_length": 512,
                     "sampler.length_buckets": (64, 256), "rl.buckets": (256, 512),
                     "loss.micro_batches": 1}.items():
    node = cfg
    *path, leaf = key.split(".")
    for part in path:
      node = node[part]
    node[leaf] = value
  model, _, engine, _, _ = train_agent.build(cfg)
  assert model.cfg.arch == "qwen2" and str(model.cfg.dtype) == "bfloat16"
  assert len(engine.tok) == vocab and engine.fmt is T.QWEN25
  assert [s["function"]["name"] for s in engine.tools] == ["search"]
  text = tools.render_call("search", {"query": "Vorland"}) + "<|im_end|>"
  ids = T.encode(engine.tok, text)
  assert ids == T.encode(qwen_tokenizer, text)
  # <tool_call> is one of Qwen's tokens; the turn ends at <|im_end|>, after the call.
  assert engine.tok.convert_ids_to_tokens(ids[0]) == "<tool_call>"
  assert engine.stops.scan(ids) == len(ids) - 1
  engine.close()
  built, started = [], []
  init_train_state, trainer_init = train_agent.train.init_train_state, rl.RLTrainer.__init__
  monkeypatch.setattr(train_agent.train, "init_train_state",
                      lambda *a, **k: built.append(init_train_state(*a, **k)) or built[-1])
  monkeypatch.setattr(rl.RLTrainer, "__init__", lambda self, engine, step, state, *a, **k: (
      started.append(state), trainer_init(self, engine, step, state, *a, **k))[1])
  summary = train_agent.run(cfg, tmp_path / "run")
  (_, state), = built
  assert cfg.sft.steps == 0 and state.ref_params is not None
  assert all(a is b for a, b in zip(
      jax.tree.leaves((state.opt_state, state.ref_params)),
      jax.tree.leaves((started[0].opt_state, started[0].ref_params)), strict=True))
  rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  rl_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in rl_rows] == [1, 2]
  assert all(math.isfinite(r["train/loss"]) for r in rl_rows)
  assert all(r["train/batch_tokens"] > 0 for r in rl_rows)
  assert 0.0 <= summary["rl_success"] <= 1.0


@pytest.mark.parametrize("field, value, message", [
    ("iterations", -1, "iterations = -1 must be >= 0"),
    ("eval_every", 0, "eval_every = 0 must be >= 1"),
    ("checkpoint_every", 0, "checkpoint_every = 0 must be >= 1"),
    ("checkpoint_write_gb", 0.0, "checkpoint_write_gb = 0.0 must be > 0"),
    ("eval_samples", -1, "eval_samples = -1 must be >= 0"),
    ("optim.learning_rate", 0.0, "optim.learning_rate = 0.0 must be > 0"),
    ("rl_optim.learning_rate", -1e-4, "rl_optim.learning_rate = -0.0001 must be > 0"),
    ("sft.steps", -1, "sft.steps = -1 must be >= 0"),
    ("sft.batch_size", 0, "sft.batch_size = 0 must be >= 1"),
    ("sft.stop_at_success", 1.5, "sft.stop_at_success = 1.5 must be in [0, 1]"),
    ("sft.check_every", 0, "sft.check_every = 0 must be >= 1"),
    ("sampler.num_slots", 0, "sampler.num_slots = 0 must be >= 1"),
    ("rl.group_size", 0, "rl.group_size = 0 must be >= 1"),
    ("rl.tasks_per_iteration", 0, "rl.tasks_per_iteration = 0 must be >= 1"),
    ("rollout.max_turns", 0, "rollout.max_turns = 0 must be >= 1"),
    ("rollout.env_workers", 0, "rollout.env_workers = 0 must be >= 1"),
    ("rl.credit", "grpoo", "rl.credit = 'grpoo' must be one of ('grpo',"),
    ("algorithm", "ppo", "algorithm = 'ppo' must be one of ('', 'grpo',"),
    ("loss.agg", "mean", "loss.agg = 'mean' must be one of ('token-mean',"),
    ("loss.kl_kind", "k1", "loss.kl_kind = 'k1' must be one of ('k2', 'k3', 'k1+', 'k3+')"),
    ("loss.is_correction", "is", "loss.is_correction = 'is' must be one of ('none',"),
    ("loss.temperature", 0.0, "loss.temperature = 0.0 must be > 0"),
    ("rl.max_staleness", -1, "rl.max_staleness = -1 must be >= 0"),
    ("rl.top_variance_frac", 0.0, "rl.top_variance_frac = 0.0 must be in (0, 1]"),
    ("rl.pack_row_multiple", 0, "rl.pack_row_multiple = 0 must be >= 1"),
    ("mesh.sampler_devices", -1, "mesh.sampler_devices = -1 must be >= 0"),
    ("env.name", "chess", "env.name = 'chess' does not load: unknown environment 'chess'"),
])
def test_bad_flags_fail_before_any_work(tmp_path, field, value, message):
  cfg = default.get_config()
  base.validate(cfg)  # the default is valid
  *path, leaf = field.split(".")
  node = cfg
  for part in path:
    node = node[part]
  node[leaf] = value
  with pytest.raises(base.ConfigError, match=re.escape(message)):
    train_agent.run(cfg, tmp_path / "run")
  assert not (tmp_path / "run").exists(), "nothing was written"


@pytest.mark.parametrize("fields, message", [
    ({"rl.max_staleness": 1}, "set loss.is_correction='tis'"),
    ({"rollout.temperature": 1.3}, "rollout.temperature=1.3 samples another distribution "
     "than the policy the loss trains (loss.temperature=1.0)"),
    ({"rollout.top_p": 0.9}, "rollout.top_k=0, rollout.top_p=0.9 sample a filtered"),
    ({"rl.buckets": (256, 384)}, "buckets=(256, 384) must hold a full episode: the largest "
     "entry >= the context budget (512 tokens)"),
    ({"sft.stop_at_success": 0.5, "sft.num_demos": 390},
     "sft.check_tasks = 32 must be >= 1 and fit after sft.num_demos in env.num_train_tasks"),
    ({"rl.overlong_buffer": "cache_length"}, "must be below the context budget"),
    ({"rl.credit": "branching", "rl.token_budget": 64},
     "cannot run with partial rollouts (token_budget)"),
    ({"rl.credit": "branching", "rl.max_staleness": 1, "loss.is_correction": "tis"},
     "it cannot run with max_staleness > 0"),
    ({"rl.pack": True, "rl.pack_row_multiple": 3, "loss.micro_batches": 2},
     "pack_row_multiple=3 must divide by loss.micro_batches=2"),
    ({"rl.pack": True, "rl.pack_row_multiple": 3, "mesh.data": 2},
     "rl.pack_row_multiple = 3 x mesh.num_processes must divide by mesh data x fsdp = 2"),
])
def test_rules_across_fields_fail_before_any_work(tmp_path, fields, message):
  # RLTrainer applies the same rules, but only once SFT has run.
  cfg = default.get_config()
  for field, value in fields.items():
    section, leaf = field.split(".")
    cfg[section][leaf] = cfg.sampler.cache_length if value == "cache_length" else value
  with pytest.raises(base.ConfigError, match=re.escape(message)):
    train_agent.run(cfg, tmp_path / "run")
  assert not (tmp_path / "run").exists(), "nothing was written"


def test_a_config_names_any_registered_credit_scheme():
  cfg = default.get_config()
  cfg.rl.credit = "test_config_scheme"
  with pytest.raises(base.ConfigError, match="test_config_scheme"):
    base.validate(cfg)
  credit.register("test_config_scheme", needs_values=True, replace=True)(
      lambda x: credit.Credit(turns=x.values))
  base.validate(cfg)
  assert train_agent._value_head(cfg)  # the scheme needs values: the model gets a head


@pytest.mark.parametrize("override, message", [
    ("--config.not_a_field=1", "config has no field 'not_a_field'; its fields: algorithm,"),
    ("--config.rl.grup_size=4", "config.rl has no field 'grup_size'; its fields: "
                                "branch_size, buckets, credit,"),
])
def test_an_unknown_config_field_names_itself(override, message):
  out = subprocess.run(
      [sys.executable, "experiments/train_agent.py",
       "--config=experiments/configs/frozen_lake_turn_credit.py:gae", override],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode != 0
  assert f"FATAL Flags parsing error: {override}: {message}" in out.stderr, out.stderr[-2000:]


def test_bf16_configs_train_float32_masters():
  # model.dtype is the compute dtype; the trained weights are param_dtype's.
  cfg = default.get_config()
  cfg.model.dtype = "bfloat16"
  model = train_agent.build_model(cfg)
  leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert model.cfg.dtype == "bfloat16"
  assert {leaf.get_value().dtype.name for _, leaf in leaves} == {"float32"}


def test_config_sections_are_the_library_dataclasses():
  # One source of defaults: each section holds every field of its dataclass,
  # and a value differs from the library default only where base.py says so.
  import dataclasses  # pylint: disable=g-import-not-at-top
  cpu_choices = {
      "rollout": {"max_action_tokens", "max_observation_tokens", "env_workers", "lockstep"},
      "optim": {"learning_rate", "total_steps", "b2"},
      "rl_optim": {"learning_rate", "warmup_steps", "total_steps", "b2"},
      "loss": set(), "rl": {"buckets"}, "model.lora": set()}
  cfg = base.get_config()
  for name, cls in base.SECTIONS.items():
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    assert set(cfg[name]) == set(fields), name
    differ = {k for k, v in fields.items() if cfg[name][k] != v}
    assert differ == cpu_choices[name], name
    cls(**cfg[name])  # builds as is
  # The accelerator config overlaps tool calls with decoding.
  assert not qwen_tpu.get_config("/m").rollout.lockstep


def test_optional_fields_take_flags(tmp_path):
  # A None default is a typed reference, so a flag can set it (the run then
  # stops at validation, having parsed every flag).
  out = subprocess.run(
      [sys.executable, "experiments/train_agent.py", f"--workdir={tmp_path}",
       "--config.loss.dual_clip=3.0", "--config.rollout.max_decode_batch=8",
       "--config.rollout.env_deadline_s=2.5", "--config.sampler.num_slots=0"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert "sampler.num_slots = 0 must be >= 1" in out.stderr, out.stderr[-2000:]


def test_the_progress_bar_shows_success_only_where_evaluated():
  assert train_agent.progress_postfix({"rollout/reward_mean": 0.5}) == {"reward": "0.50"}
  assert train_agent.progress_postfix({"rollout/reward_mean": 0.5, "eval/success": 0.25}
                                      ) == {"reward": "0.50", "success": "0.25"}


def test_pytest_is_a_test_requirement_only():
  names = lambda f: {l.split("==")[0] for l in (ROOT / f).read_text().splitlines()
                     if l and not l.startswith(("#", "-"))}
  assert "pytest" not in names("requirements.txt")
  assert "pytest" in names("requirements-dev.txt")


def test_the_run_hands_checkpoint_write_gb_to_its_checkpointer(tmp_path, monkeypatch):
  class Built(Exception):
    pass

  seen = {}

  def checkpointer(directory, **kwargs):
    seen.update(kwargs)
    raise Built  # nothing past the checkpointer is needed

  cfg = default.get_config()
  cfg.checkpoint_write_gb = 0.5
  monkeypatch.setattr(train_agent.checkpointing, "Checkpointer", checkpointer)
  with pytest.raises(Built):
    train_agent.run(cfg, tmp_path / "run")
  assert seen["write_gb"] == 0.5


def test_the_smollm2_config_runs_its_smoke_variant_on_a_tiny_gguf(tmp_path):
  """A tiny random Llama in a GGUF file with SmolLM2's own chat template
  stands in for the real one: the config reads model, tokenizer and chat
  format from the file, and SFT and an RL iteration on the arithmetic tool
  task run end to end."""
  import test_gguf  # pylint: disable=import-outside-toplevel
  hf = test_gguf._hf_config("llama")  # pylint: disable=protected-access
  template = (ROOT / "tests/data/smollm2_chat_template.jinja").read_text()
  path = test_gguf._write_gguf(tmp_path / "tiny.gguf", hf,  # pylint: disable=protected-access
                               test_gguf._weights(hf), chat_template=template)
  cfg = smollm2_calculator.get_config(f"{path},smoke")
  base.validate(cfg)
  _, _, engine, _, _ = train_agent.build(cfg)
  assert engine.fmt.name == "template" and "word problem" in engine.system_prompt
  assert [s["function"]["name"] for s in engine.tools] == ["calculate"]
  engine.close()
  train_agent.run(cfg, tmp_path / "run")
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["sft_steps"] == 2 and 0.0 <= summary["rl_success"] <= 1.0
  full, accel = smollm2_calculator.get_config(str(path)), smollm2_calculator.get_config(
      f"{path},accelerator")
  for c in (full, accel):
    base.validate(c)
    assert c.model.path == str(path) and c.model.remat
  with pytest.raises(ValueError, match="unknown variant 'tpu'"):
    smollm2_calculator.get_config(f"{path},tpu")


def test_the_accelerator_config_has_a_smoke_variant():
  full, smoke = qwen_tpu.get_config("/m"), qwen_tpu.get_config("/m,smoke")
  assert smoke.model.path == full.model.path == "/m"
  assert (smoke.iterations, smoke.rl.tasks_per_iteration * smoke.rl.group_size) == (1, 4)
  assert smoke.rl.buckets == (1024,) and smoke.sampler.cache_length == 1024
  assert smoke.model.param_dtype == "float32" and smoke.model.dtype == "bfloat16"
  assert smoke.checkpoint_write_gb == 1.0 and full.checkpoint_write_gb == 96.0
  base.validate(smoke)
  with pytest.raises(ValueError, match="unknown variant 'fast'"):
    qwen_tpu.get_config("/m,fast")
