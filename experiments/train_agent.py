"""Train an agent: SFT warm start on the expert, then agentic RL.

  python experiments/train_agent.py --config=experiments/configs/default.py \
      --workdir=runs/default [--config.seed=1 --config.rl.group_size=8 ...]

Writes to the workdir: config.json (the resolved config), metrics.jsonl and
tb/ (TensorBoard), checkpoints/ (orbax; rerunning with the same --workdir
resumes from the latest one), curves.png. Prints held-out success after SFT
and after RL. Same config and seed give identical results on CPU (the
rollout runs in lockstep; see RolloutConfig.lockstep).

Multi-host (one process per host, `agentrl_jax.distributed`): every host runs
the same command with `--config.mesh.multihost=True` and a mesh over the
devices of all hosts, e.g. on each worker of a TPU VM slice (`gcloud compute
tpus tpu-vm ssh NAME --worker=all --command=...`), where JAX finds its peers
itself; elsewhere add `--config.mesh.coordinator=HOST0:PORT
--config.mesh.num_processes=N --config.mesh.process_id=I`. Each host samples
on its own devices and environments (its share of every iteration's tasks);
the train step runs on the global mesh. The workdir must be shared (NFS, a
bucket): every process writes its shards of a checkpoint, and process 0 the
metrics, plots and summary.
"""

import dataclasses
import importlib.util
import itertools
import math
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from absl import app, flags, logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_flags
import tqdm

from agentrl_jax import (checkpointing, distributed, envs, metrics, models, sharding, train,
                         viewer)
from agentrl_jax import tokenizer as tok_lib
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax.sampling import Sampler
from agentrl_jax.train import credit, memory, presets, rl, sft
from configs import base as config_base
import plot_curves

_DEFAULT_CONFIG = "experiments/configs/default.py"
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Output directory.")

def build_model(cfg):
  """Compute in `model.dtype`, train `model.param_dtype` masters; with
  `model.lora.rank` > 0, adapters on the base (which then stays frozen)."""
  dtype, param_dtype = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.param_dtype)
  if cfg.model.path:
    model = models.from_pretrained(cfg.model.path, dtype=dtype, param_dtype=param_dtype,
                                   value_head=_value_head(cfg), remat=cfg.model.remat)
  else:
    model = models.Decoder(models.tiny_config(
        cfg.model.arch, dtype=dtype, param_dtype=param_dtype, value_head=_value_head(cfg),
        remat=cfg.model.remat, **cfg.model.tiny), rngs=nnx.Rngs(cfg.seed))
  # The adapters' own stream: the base's draws stay those of the plain model.
  rngs = nnx.Rngs(jax.random.fold_in(jax.random.key(cfg.seed), 1))
  return models.add_adapters(model, models.LoraConfig(**cfg.model.lora), rngs)


def _value_head(cfg) -> bool:
  return cfg.model.value_head or credit.scheme(cfg.rl.credit).needs_values


def _mesh_config(cfg) -> sharding.MeshConfig:
  return sharding.MeshConfig(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor)


def _device_split(cfg):
  """(the trainer's devices, the sampler's own or None): `mesh.sampler_devices`
  takes the last devices for the sampler alone."""
  devices, k = jax.devices(), cfg.mesh.sampler_devices
  if not k:
    return devices, None
  if k >= len(devices):
    raise ValueError(f"mesh.sampler_devices={k} leaves none of the {len(devices)} "
                     "devices to the trainer")
  return devices[:-k], devices[-k:]


def build_mesh(cfg):
  """The trainer's device mesh (global with several hosts), or None for one device."""
  mesh_cfg = _mesh_config(cfg)  # its fit to the batch: config_base.validate
  if mesh_cfg.shape == (1, 1, 1) and not cfg.mesh.multihost:
    return None
  return sharding.make_mesh(mesh_cfg, _device_split(cfg)[0])


def sampler_mesh(cfg, mesh):
  """The sampler's mesh: the training mesh, each host's own devices with
  several hosts, or the devices `mesh.sampler_devices` set apart."""
  if cfg.mesh.multihost:
    return distributed.local_mesh(_mesh_config(cfg))
  _, own = _device_split(cfg)
  return mesh if own is None else sharding.mesh_like(_mesh_config(cfg), own)


def build(cfg, mesh=None):
  """The model, its sampler and rollout engine, and the train/held-out tasks.

  mesh: the sampler's mesh (`sampler_mesh`), or None for one device.
  """
  # The environment's contract first: a missing piece fails before any work.
  make_env = envs.env_class(cfg.env.name)
  probe = make_env(**cfg.env.kwargs)
  try:
    envs.check(probe, need_tasks=True, need_expert=cfg.sft.steps > 0)
    train_tasks = probe.tasks("train", cfg.env.num_train_tasks, cfg.seed,
                              **cfg.env.task_kwargs)
    eval_tasks = probe.tasks("test", cfg.env.num_eval_tasks, cfg.seed,
                             **cfg.env.task_kwargs)
  finally:
    probe.close()
  tok = tok_lib.load_tokenizer(cfg.model.tokenizer or None)
  model = build_model(cfg)
  sampler = Sampler(model, num_slots=cfg.sampler.num_slots,
                    cache_length=cfg.sampler.cache_length,
                    max_decode_length=cfg.rollout.max_action_tokens,
                    length_buckets=tuple(cfg.sampler.length_buckets),
                    attention_windows=tuple(cfg.sampler.attention_windows) or None,
                    mesh=mesh, policy_temperature=cfg.loss.temperature)
  engine = RolloutEngine(
      lambda: make_env(**cfg.env.kwargs), tok, tok_lib.get_format(cfg.env.chat_format, tok),
      sampler, RolloutConfig(**cfg.rollout), seed=cfg.seed)
  return model, sampler, engine, train_tasks, eval_tasks


def progress_postfix(m: dict) -> dict[str, str]:
  """The RL bar's new fields: the rollout reward, and held-out success only
  where this iteration evaluated (the bar keeps the last one shown)."""
  shown = {"reward": f"{m['rollout/reward_mean']:.2f}"}
  if "eval/success" in m:
    shown["success"] = f"{m['eval/success']:.2f}"
  return shown


def _refill(pool, chosen, rng):
  """n -> n more tasks of the pool, none of `chosen` nor drawn before, in a
  random order (drawn on first use: an iteration without refill leaves its
  draws as they were)."""
  spare = None

  def draw(n: int):
    nonlocal spare
    if spare is None:
      spare = iter(rng.permutation(np.setdiff1d(np.arange(len(pool)), chosen)).tolist())
    return [pool[i] for i in itertools.islice(spare, n)]
  return draw


def fit_memory(cfg, graphdef, state, tx, rl_tx, sampler, mesh) -> tuple[int, int]:
  """(SFT's, RL's) micro-batches: the configured ones, or the fewest more
  that bring each step's estimate (`train.memory`, at its largest batch:
  `sft.batch_size` or every episode of an iteration, rows of the largest
  bucket) under the memory budget; MemoryBudgetError where none does.
  `memory_gb` < 0 skips the estimates."""
  if cfg.memory_gb < 0:
    return cfg.sft.micro_batches, cfg.loss.micro_batches
  budget = memory.memory_budget_gib(cfg.memory_gb)
  length = max(cfg.rl.buckets)
  # Held through both steps: the sampler's cache; its weights through SFT,
  # and through RL's step when rollouts run beside it (else dropped).
  cache = memory.tree_gib(jax.eval_shape(sampler.init_state, 0))
  weights = memory.tree_gib(sampler.params)
  sft_micro, rl_micro = cfg.sft.micro_batches, cfg.loss.micro_batches
  fitted = []
  if cfg.sft.steps > 0:
    est = memory.fit_micro_batches(
        lambda n: train.SFTStep(graphdef, tx, mesh=mesh, micro_batches=n), state,
        rows=cfg.sft.batch_size, length=length, budget_gib=budget, micro_batches=sft_micro,
        other_gib=cache + weights, what="SFT's step")
    sft_micro = est.micro_batches
    fitted.append(("SFT", est))
  if cfg.iterations > 0:
    loss_cfg = train.LossConfig(**cfg.loss)
    est = memory.fit_micro_batches(
        lambda n: train.RLStep(graphdef, rl_tx, dataclasses.replace(loss_cfg, micro_batches=n),
                               mesh=mesh), state,
        rows=cfg.rl.tasks_per_iteration * cfg.rl.group_size, length=length,
        budget_gib=budget, micro_batches=rl_micro,
        multiple_of=cfg.rl.pack_row_multiple if cfg.rl.pack else None,
        other_gib=cache + (weights if cfg.rl.max_staleness else 0.0), what="RL's step")
    rl_micro = est.micro_batches
    fitted.append(("RL", est))
  if distributed.is_primary():
    for what, est in fitted:
      print(f"memory: {what} step {est.describe()}; budget {budget:.2f} GiB")
  return sft_micro, rl_micro


def run(cfg, workdir, explicit=()) -> dict | None:
  """SFT then RL as configured, into `workdir` (resuming from it); the summary
  (process 0's; the other processes of a multi-host run return None).

  explicit: the config fields set by flags ("loss.clip_high", ...): a named
  `algorithm` sets its fields except these.
  """
  kept, replaced = [], {}
  if cfg.algorithm in presets.PRESETS:  # its defaults first; a bad name: validate
    kept = presets.kept_fields(explicit)
    replaced = presets.changes(cfg, cfg.algorithm, keep=explicit)
    presets.apply(cfg, cfg.algorithm, keep=explicit)
  config_base.validate(cfg)  # a bad flag fails here, before any work
  if cfg.mesh.multihost:  # before any other JAX call
    distributed.initialize(cfg.mesh.coordinator, cfg.mesh.num_processes,
                           cfg.mesh.process_id)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
  primary = distributed.is_primary()
  if cfg.algorithm and primary:
    print(presets.describe(cfg.algorithm, cfg, overridden=kept, replaced=replaced))
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if primary:
    (workdir / "config.json").write_text(cfg.to_json_best_effort(indent=2))
  mesh = build_mesh(cfg)
  model, sampler, engine, train_tasks, eval_tasks = build(cfg, sampler_mesh(cfg, mesh))

  # -- Train state, checkpoints, logging -------------------------------------------
  tx = train.make_optimizer(train.OptimConfig(**cfg.optim))
  rl_tx = train.make_optimizer(train.OptimConfig(**cfg.rl_optim))
  # The first phase's optimizer: no SFT moments are made for a run without SFT.
  graphdef, state = train.init_train_state(model, tx if cfg.sft.steps > 0 else rl_tx,
                                           with_reference=cfg.loss.kl_beta > 0)
  del model  # the state and the sampler hold their own copies
  # What each step needs, against the budget: a run that would not fit stops
  # here, before any work (not killed mid-run).
  sft_micro, rl_micro = fit_memory(cfg, graphdef, state, tx, rl_tx, sampler, mesh)
  ckpt = checkpointing.Checkpointer(workdir / "checkpoints", max_to_keep=cfg.keep_checkpoints,
                                    write_gb=cfg.checkpoint_write_gb)
  progress = {"phase": "sft", "iteration": 0, "sft_success": None}

  pass_key = f"pass_at_{cfg.eval_samples}"

  def sampled():
    """Held-out metrics sampled at temperature 1 (the raw logits: the policy
    RL trains at the default loss.temperature, a sharper one than it trains
    above 1), seeded: eval_samples episodes per task give "success_sampled"
    (avg@k) and, with k > 1, the unbiased pass@k (`rl.pass_at_k`)."""
    if not cfg.eval_samples:
      return {"success_sampled": float("nan")}
    m = rl.evaluate(engine, eval_tasks, temperature=1.0, samples=cfg.eval_samples,
                    seed=cfg.seed + 12345)
    return {"success_sampled": m["success"],
            **({pass_key: m[pass_key]} if pass_key in m else {})}
  resume = ckpt.latest_step()
  if resume is not None:
    # The KL reference as saved: a run may resume another's checkpoint with
    # kl_beta changed (an ablation arm from a shared SFT start).
    saved_ref = ckpt.saved_tree(resume).get("ref_params") is not None
    wants_ref = state.ref_params is not None
    # A checkpoint holds no frozen LoRA base: the one built above is it.
    abstract = jax.eval_shape(lambda: train.checkpointed(state).replace(ref_params=(
        train.reference_params(state.params, cfg.model.dtype) if saved_ref else None)))
    if mesh is not None:  # restore straight into the shards
      abstract = sharding.abstract_state(abstract, sharding.param_shardings(abstract, mesh))
    # A step that does not read back (a crash mid-write) is skipped, warned.
    resume, restored, progress = ckpt.restore_latest(abstract_state=abstract)
    state = restored.replace(frozen=state.frozen)
    if saved_ref and not wants_ref:
      state = state.replace(ref_params=None)
    elif wants_ref and not saved_ref:
      if progress["phase"] != "rl" or progress["iteration"] != 0:
        raise ValueError(
            f"loss.kl_beta > 0, but checkpoint step {resume} in {workdir / 'checkpoints'} "
            f"holds no KL reference (saved with kl_beta = 0, at {progress['phase']} "
            f"iteration {progress['iteration']}); the reference is the policy RL "
            f"started from, known only at RL iteration 0: resume from such a "
            f"checkpoint, or set loss.kl_beta=0")
      # At RL iteration 0 the policy is the one RL starts from: the reference.
      state = state.replace(ref_params=train.reference_params(state.params, cfg.model.dtype))
    sampler.update_params(state.model_params)
    if primary:
      print(f"resumed from {workdir / 'checkpoints'} step {resume}: {progress}")
  writer = metrics.MetricsWriter(workdir, resume_step=resume) if primary else None

  def log(step, m, prefix=""):
    if writer is not None:
      writer.write(step, m, prefix=prefix)

  episodes_file = workdir / "trajectories.jsonl"
  if primary and resume is not None and episodes_file.exists():  # drop what is redone
    viewer.write_jsonl(episodes_file, [r for r in viewer.read_jsonl(episodes_file)
                                       if r["iteration"] <= resume], append=False)

  solved = {}  # greedy outcome per held-out task (this process's share) at SFT, at the end

  def evaluate(iteration):
    """Greedy held-out metrics; records the first episodes for the viewer."""
    trajs = []
    m = rl.evaluate(engine, eval_tasks, trajectories=trajs, policy_version=iteration)
    solved[iteration] = {t.metadata["task_id"]: bool(t.metadata["success"]) for t in trajs}
    if primary and cfg.log.eval_episodes:
      viewer.write_jsonl(episodes_file, [
          viewer.episode_record(t, engine.tok, iteration=iteration, phase="eval")
          for t in trajs[:cfg.log.eval_episodes]])
    return m

  # -- SFT warm start ------------------------------------------------------------------
  if progress["phase"] == "sft" and cfg.sft.steps > 0:  # 0: the model already acts
    # Every host makes the same (scripted, seeded) demos: SFT batches are
    # global values that each host places its shards of.
    demos = sft.expert_demos(engine, train_tasks[:cfg.sft.num_demos],
                             keep_failed=cfg.sft.keep_failed)
    bar = tqdm.tqdm(total=cfg.sft.steps, desc="SFT", unit="step", disable=not primary)

    def on_step(i, m):
      progress["sft_steps"] = i + 1
      bar.update()
      bar.set_postfix(loss=f"{m['sft_loss']:.3f}")
      if i % 10 == 0 or i == cfg.sft.steps - 1:
        # SFT steps sit before RL on one axis: -steps .. -1, RL from 0.
        log(i - cfg.sft.steps, m, prefix="sft/")

    check_tasks = train_tasks[cfg.sft.num_demos:cfg.sft.num_demos + cfg.sft.check_tasks]

    def check(state):
      """Greedy success on training-split tasks SFT was not shown."""
      sampler.update_params(state.model_params)
      success = rl.evaluate(engine, check_tasks)["success"]
      log(progress["sft_steps"] - 1 - cfg.sft.steps, {"check_success": success}, prefix="sft/")
      bar.set_postfix(check_success=f"{success:.3f}")
      return success

    stop = (sft.stop_at_success(check, target=cfg.sft.stop_at_success,
                                every=cfg.sft.check_every)
            if cfg.sft.stop_at_success else None)
    state = sft.distill(train.SFTStep(graphdef, tx, mesh=mesh, micro_batches=sft_micro),
                        state, demos,
                        steps=cfg.sft.steps,
                        batch_size=cfg.sft.batch_size, buckets=cfg.rl.buckets,
                        pack=cfg.rl.pack, share_prompts=cfg.rl.share_prompts,
                        row_multiple=math.lcm(sft_micro, cfg.mesh.data * cfg.mesh.fsdp),
                        seed=cfg.seed, on_step=on_step, stop=stop)
    bar.close()
    if primary and progress["sft_steps"] < cfg.sft.steps:
      print(f"SFT stopped after {progress['sft_steps']} of {cfg.sft.steps} steps: greedy "
            f"success >= {cfg.sft.stop_at_success} on {len(check_tasks)} training tasks "
            f"without demos")
    sampler.update_params(state.model_params)
  if progress["phase"] == "sft":
    if cfg.sft.steps > 0:
      # RL starts from the SFT policy: it is also the KL reference. The SFT
      # moments and reference go first: never two sets in memory.
      state = state.replace(opt_state=None, ref_params=None)
      state = state.replace(opt_state=rl_tx.init(state.params), ref_params=(
          train.reference_params(state.params, cfg.model.dtype) if cfg.loss.kl_beta > 0
          else None))
    # Without SFT the state was built for RL (rl_tx's moments, the loaded
    # policy as reference): building them again would free and reallocate
    # gigabytes, which the host heap keeps (+3.6 GiB of RSS at 0.5B on CPU).
    if mesh is not None:  # the fresh optimizer counters too: checkpoints save shards
      state = sharding.shard(state, sharding.param_shardings(state, mesh))
    progress = {"phase": "rl", "iteration": 0, "sft_steps": progress.get("sft_steps", 0),
                "sft_success": evaluate(0)["success"],
                "sft_solved": sorted(k for k, v in solved[0].items() if v)}
    at_start = sampled()
    progress.update({f"sft_{k}": v for k, v in at_start.items()})
    log(0, {"success": progress["sft_success"], **at_start}, prefix="eval/")
    ckpt.save(0, train.checkpointed(state), progress)
  if primary:
    print(f"held-out success after SFT: {progress['sft_success']:.3f}")

  # -- RL ------------------------------------------------------------------------------
  loss_cfg = train.LossConfig(**{**cfg.loss, "micro_batches": rl_micro})
  trainer = rl.RLTrainer(engine, train.RLStep(graphdef, rl_tx, loss_cfg, mesh=mesh),
                         state, rl.RLConfig(**cfg.rl), seed=cfg.seed)
  first = progress["iteration"]
  postfix = {}

  def draw(it):
    """Iteration it's task pool, its draw of tasks, and the generator drawn from."""
    rng = np.random.default_rng([cfg.seed, it])
    pool = rl.curriculum_pool(train_tasks, cfg.curriculum, it)
    return pool, rng.choice(len(pool), cfg.rl.tasks_per_iteration, replace=False), rng

  def upcoming(version):
    """The tasks of RL iteration `version` (rollouts started ahead), None past the end."""
    if version > cfg.iterations:
      return None
    pool, chosen, _ = draw(version - 1)
    return [pool[i] for i in chosen]

  bar = tqdm.tqdm(range(first, cfg.iterations), desc="RL", unit="it", initial=first,
                  total=cfg.iterations, disable=not primary)
  for it in bar:
    pool, chosen, rng = draw(it)
    tasks = [pool[i] for i in chosen]
    t0 = time.perf_counter()
    record = bool(cfg.log.trajectories_every) and (it + 1) % cfg.log.trajectories_every == 0
    m = trainer.iteration(tasks, it + 1, refill=_refill(pool, chosen, rng), record=record,
                          upcoming=upcoming)
    m["time/iteration_s"] = time.perf_counter() - t0  # rollouts + credit + step
    if record and primary:
      r = trainer.recorded
      viewer.write_jsonl(episodes_file, [
          viewer.episode_record(r.trajectories[i], engine.tok, iteration=it + 1,
                                phase="train", batch=r.batch, seq=i,
                                trainer_logprobs=r.trainer_logprobs)
          for i in viewer.sample_groups(r.trajectories, cfg.log.per_group)])
    if (it + 1) % cfg.eval_every == 0 or it + 1 == cfg.iterations:
      trainer.settle()  # the rollouts in flight finish first: the evaluation has the engine
      m.update({f"eval/{k}": v for k, v in evaluate(it + 1).items()})
    if it + 1 == cfg.iterations:
      m.update({f"eval/{k}": v for k, v in sampled().items()})
    log(it + 1, m)
    postfix.update(progress_postfix(m))
    bar.set_postfix(postfix)
    if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations:
      ckpt.save(it + 1, train.checkpointed(trainer.state), {**progress, "iteration": it + 1})
  trainer.close()
  ckpt.close()
  engine.close()
  if not primary:
    return None
  writer.close()

  last = metrics.read_metrics(workdir)[-1]
  final = last.get("eval/success", float("nan"))
  final_sampled = last.get("eval/success_sampled", float("nan"))
  plot_curves.report({workdir.name: [metrics.read_metrics(workdir)]}, workdir / "curves.png")
  summary = {"sft_steps": progress.get("sft_steps", 0),
             "sft_success": progress["sft_success"], "rl_success": final,
             "sft_success_sampled": progress.get("sft_success_sampled", float("nan")),
             "rl_success_sampled": final_sampled}
  if f"eval/{pass_key}" in last:
    summary.update({f"sft_{pass_key}": progress.get(f"sft_{pass_key}", float("nan")),
                    f"rl_{pass_key}": last[f"eval/{pass_key}"]})
  gain = ""
  # Paired on the held-out tasks: one process holds them all (several would
  # each hold their share of the per-task outcomes).
  if jax.process_count() == 1 and cfg.iterations in solved and "sft_solved" in progress:
    at_sft = set(progress["sft_solved"])
    before = {k: float(k in at_sft) for k in solved[cfg.iterations]}
    summary["greedy_gain"], summary["greedy_gain_se"] = rl.paired_gain(
        before, {k: float(v) for k, v in solved[cfg.iterations].items()})
    gain = f" (gain {summary['greedy_gain']:+.3f}, paired SE {summary['greedy_gain_se']:.3f})"
  (workdir / "summary.json").write_text(json.dumps(summary))
  print(f"held-out success after SFT: {progress['sft_success']:.3f}, after RL: {final:.3f} "
        f"(greedy{gain}); sampled at temperature 1: {summary['sft_success_sampled']:.3f} -> "
        f"{final_sampled:.3f}" + (f", pass@{cfg.eval_samples} {summary[f'sft_{pass_key}']:.3f} "
                                  f"-> {summary[f'rl_{pass_key}']:.3f}"
                                  if f"rl_{pass_key}" in summary else ""))
  print(f"curves: {workdir / 'curves.png'}; checkpoints: {workdir / 'checkpoints'}")
  return summary


def main(argv):
  del argv
  try:
    explicit = config_flags.get_override_values(flags.FLAGS["config"])
    run(_CONFIG.value, _WORKDIR.value, explicit=_flat_keys(explicit))
  except (config_base.ConfigError, envs.ContractError) as e:
    raise app.UsageError(str(e)) from None


def _flat_keys(overrides, prefix="") -> set[str]:
  """{"loss": {"clip_high": 0.3}} or {"loss.clip_high": 0.3} -> {"loss.clip_high"}."""
  keys = set()
  for key, value in overrides.items():
    if isinstance(value, dict):
      keys |= _flat_keys(value, f"{prefix}{key}.")
    else:
      keys.add(prefix + key)
  return keys


def parse_flags(argv):
  """absl's parse, with a clear message for an override of a field the
  config lacks (ml_collections raises a bare AttributeError for it)."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError):
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")),
                _DEFAULT_CONFIG)
    path, _, arg = spec.partition(":")
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location("_config", path))
    module.__spec__.loader.exec_module(module)
    cfg = module.get_config(arg) if arg else module.get_config()
    message = config_base.unknown_field(cfg, argv[1:])
    if message is None:
      raise
    raise SystemExit(f"FATAL Flags parsing error: {message}") from None


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
