"""Multi-device checks, run by test_sharding.py in a subprocess.

The parent sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before
this process imports jax. Each check prints `PASS <name>` or `FAIL <name>`
and a traceback; the exit code is the number of failures.
"""

import tempfile

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from agentrl_jax import models, sharding, train
from agentrl_jax import tokenizer as T
from agentrl_jax.checkpointing import Checkpointer
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax.sampling import Sampler
from agentrl_jax.train import rl
from _worker_checks import check, run_checks  # this script's directory leads sys.path
from test_rl_learning import LookupEnv
from test_train_step import _batch


def _mesh(**axes):
  return sharding.make_mesh(sharding.MeshConfig(**axes))


def _close(a, b, atol=1e-5, rtol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


def _shardings(tree):
  return [x.sharding for x in jax.tree.leaves(tree)]


@check
def rl_step_matches_single_device():
  model = models.Decoder(models.tiny_config("llama", vocab_size=64), rngs=nnx.Rngs(0))
  # SGD with momentum: an update linear in the gradient (AdamW's first steps,
  # ~lr * sign(g), would amplify the rounding of near-zero gradients), and
  # an optimizer state that mirrors the params.
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
  cfg = train.LossConfig(kl_beta=0.05, entropy_coef=0.01, micro_batches=2)
  batches = [_batch(0), _batch(1)]
  mesh = _mesh(data=2, fsdp=2, tensor=2)
  results = []
  for step_mesh in (None, mesh):
    graphdef, state = train.init_train_state(model, tx, with_reference=True)
    step = train.RLStep(graphdef, tx, cfg, mesh=step_mesh)
    metrics = []
    for batch in batches:
      state, m = step(state, batch)
      metrics.append(m)
    results.append((state, metrics, step))
  (state1, metrics1, _), (state8, metrics8, step8) = results
  _close(metrics1, metrics8)
  _close(state1, state8)
  assert step8.traces == 1, step8.traces
  # The state stays on the rules' layout (what the jit was built for).
  assert _shardings(state8) == jax.tree.leaves(sharding.param_shardings(state8, mesh))
  q = state8.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
  assert q.sharding.shard_shape(q.shape) == (64, 64), q.sharding
  trace = state8.opt_state[1][0].trace["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
  assert trace.sharding == q.sharding
  # Hot path: a placed batch in, metrics left on device: no host transfer.
  batch = sharding.shard(batches[0], sharding.batch_sharding(mesh))
  with jax.transfer_guard("disallow"):
    state8, m = step8(state8, batch)
  assert m["loss"].sharding.is_fully_replicated


@check
def lora_step_matches_single_device():
  """LoRA on a 2x2x2 mesh: the frozen base is laid out as the full model's
  weights are, the adapters replicated; the step equals one device's, and
  only the adapters change."""
  model = models.Decoder(models.tiny_config("qwen2", vocab_size=64), rngs=nnx.Rngs(0))
  model = models.add_adapters(model, models.LoraConfig(rank=4), nnx.Rngs(1))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
  cfg = train.LossConfig(kl_beta=0.05, micro_batches=2)
  mesh = _mesh(data=2, fsdp=2, tensor=2)
  results = []
  for step_mesh in (None, mesh):
    graphdef, state = train.init_train_state(model, tx, with_reference=True)
    if step_mesh is not None:
      state = sharding.shard(state, sharding.param_shardings(state, step_mesh))
    step = train.RLStep(graphdef, tx, cfg, mesh=step_mesh)
    for batch in (_batch(0), _batch(1)):
      state, m = step(state, batch)
    results.append((state, m))
  (state1, m1), (state8, m8) = results
  _close(m1, m8)
  _close(state1.params, state8.params)
  _close(state8.frozen, state1.frozen, atol=0, rtol=0)  # the base never moves
  q = state8.frozen["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
  assert q.sharding.shard_shape(q.shape) == (q.shape[0] // 2, q.shape[1] // 2), q.sharding
  a = state8.params["layers"][0]["self_attn"]["q_proj"]["lora"]["lora_a"][...]
  assert a.sharding.is_fully_replicated, a.sharding
  b = state8.params["layers"][0]["self_attn"]["q_proj"]["lora"]["lora_b"][...]
  assert np.abs(np.asarray(b)).max() > 0  # lora_b starts at zero: the step moved it


def _peaked_model():
  model = models.Decoder(models.tiny_config("qwen2", vocab_size=64), rngs=nnx.Rngs(0))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if path[-1] in ("kernel", "embedding"):
      var.set_value(var.get_value() * 4.0)
  return model


def _episode(sampler):
  """prefill 3 of 4 slots, greedy decode, extend, sampled decode, release,
  fork."""
  state = sampler.init_state(seed=3)
  prompts = {0: [1, 2, 3], 1: [5, 6, 7, 8, 9], 3: [11, 12]}
  state = sampler.prefill(state, list(prompts), list(prompts.values()))
  state, greedy = sampler.decode(state, list(prompts), max_new_tokens=6, temperature=0.0)
  state = sampler.extend(state, [0, 3], [[4, 4], [7]])
  state, sampled = sampler.decode(state, [0, 1, 3], max_new_tokens=6, temperature=1.0)
  state = sampler.release(state, [1])
  state = sampler.prefill(state, [1], [[9, 9, 9]])
  state, again = sampler.decode(state, [1], max_new_tokens=4, temperature=1.0, top_k=8)
  # Slot 2 forks slot 0's cache but its last token, then computes that one.
  held = int(state.lengths[0])
  state = sampler.fork(state, 2, sampler.snapshot(state, 0, held), held - 1)
  state = sampler.extend(state, [2], [sampled[0].tokens[-1:]])
  state, forked = sampler.decode(state, [0, 2], max_new_tokens=4, temperature=0.0)
  assert forked[0].tokens == forked[2].tokens, forked
  return state, [greedy, sampled, again, forked]


@check
def sampler_matches_single_device():
  model = _peaked_model()
  kw = dict(num_slots=4, cache_length=32, max_decode_length=6, length_buckets=(8,))
  mesh = _mesh(data=2, fsdp=2, tensor=2)
  _, want = _episode(Sampler(model, **kw))
  sampler = Sampler(model, mesh=mesh, **kw)
  state, got = _episode(sampler)
  for w, g in zip(want, got):
    assert {s: a.tokens for s, a in w.items()} == {s: a.tokens for s, a in g.items()}, (w, g)
    for s in w:
      _close(w[s].raw_logprobs, g[s].raw_logprobs)
  assert any(len(set(a.tokens)) > 1 for a in got[1].values())  # sampled, not constant
  k = state.cache.k[0]
  assert k.sharding.shard_shape(k.shape) == (1, 1, 32, 32), k.sharding  # slots, kv heads

  # Weight sync from trainers on the same and on another layout, never via
  # the host; the sampler keeps its own layout and copies.
  tx = optax.sgd(0.1)
  for trainer_mesh in (mesh, _mesh(data=8)):
    _, tstate = train.init_train_state(model, tx, with_reference=False)
    params = sharding.shard(tstate.params, sharding.param_shardings(tstate.params, trainer_mesh))
    params = jax.tree.map(lambda x: x * 0.5, params)
    with jax.transfer_guard_device_to_host("disallow"), \
         jax.transfer_guard_host_to_device("disallow"):
      sampler.update_params(params)
    assert _shardings(sampler.params) == _shardings(
        sharding.shard(params, sharding.param_shardings(params, mesh)))
    _close(sampler.params, params, atol=0, rtol=0)
    jax.tree.map(lambda x: x.delete(), params)  # as a donating train step would
    sampler.decode(sampler.prefill(state, [2], [[1, 2]]), [2], max_new_tokens=2)
    state = sampler.init_state()


@check
def checkpoint_restores_onto_another_mesh():
  model = models.Decoder(models.tiny_config("qwen2", vocab_size=64), rngs=nnx.Rngs(1))
  tx = train.make_optimizer(train.OptimConfig())
  _, state = train.init_train_state(model, tx, with_reference=True)
  saved_mesh, new_mesh = _mesh(fsdp=4, tensor=2), _mesh(fsdp=8)
  state = sharding.shard(state, sharding.param_shardings(state, saved_mesh))
  with tempfile.TemporaryDirectory() as d, Checkpointer(d) as ckpt:
    ckpt.save(1, state)
    abstract = jax.eval_shape(lambda: state)
    new_shardings = sharding.param_shardings(abstract, new_mesh)
    restored, _ = ckpt.restore(abstract_state=sharding.abstract_state(abstract, new_shardings))
  _close(state, restored, atol=0, rtol=0)
  assert _shardings(restored) == jax.tree.leaves(new_shardings)
  emb = restored.params["embed_tokens"]["embedding"][...]
  assert emb.sharding.shard_shape(emb.shape) == (64, 16), emb.sharding


@check
def async_rollouts_sample_on_their_own_devices():
  """max_staleness=1 with the trainer on devices 0-3 and the sampler on 4-7:
  weights reach the sampler device to device, each rollout samples with
  the weights of the iteration before."""
  devices = jax.devices()
  trainer_mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2), devices[:4])
  sampler_mesh = sharding.mesh_like(sharding.MeshConfig(data=2, fsdp=2), devices[4:])
  model = models.Decoder(models.tiny_config("llama"), rngs=nnx.Rngs(0))
  sampler = Sampler(model, num_slots=8, cache_length=128, max_decode_length=8,
                    length_buckets=(16, 64), mesh=sampler_mesh)
  engine = RolloutEngine(LookupEnv, T.load_tokenizer(), T.CHATML, sampler,
                         RolloutConfig(max_turns=3, max_action_tokens=8, lockstep=True))
  tx = optax.adam(1e-3)
  graphdef, state = train.init_train_state(model, tx, with_reference=False)
  state = sharding.shard(state, sharding.param_shardings(state, trainer_mesh))
  trainer = rl.RLTrainer(
      engine, train.RLStep(graphdef, tx, train.LossConfig(is_correction="tis",
                                                          entropy_coef=0.05),
                           mesh=trainer_mesh), state,
      rl.RLConfig(group_size=2, tasks_per_iteration=2, buckets=(128,), max_staleness=1))
  tasks = LookupEnv.tasks("train", 8, 0)
  on = lambda tree: {d for x in jax.tree.leaves(tree) for d in x.devices()}
  for i in range(1, 4):
    with jax.transfer_guard_device_to_host("disallow"), \
         jax.transfer_guard_host_to_device("disallow"):
      weights = sampler.prepare_params(trainer.state.params)
    assert on(weights) == set(devices[4:]), on(weights)
    m = trainer.iteration(tasks[2 * i - 2:2 * i], i, record=True,
                          upcoming=lambda j: tasks[2 * j - 2:2 * j] if j <= 3 else None)
    assert m["rollout/staleness_max"] == min(i - 1, 1), m
    assert {v for t in trainer.recorded.trajectories
            for v in t.metadata["policy_versions"]} == {max(i - 1, 1)}
  assert on(trainer.state.params) == set(devices[:4])
  assert on(sampler.params) == set(devices[4:])
  trainer.settle()
  _close(sampler.params, trainer.state.params, atol=0, rtol=0)
  trainer.close()


def main():
  assert jax.device_count() == 8, jax.devices()
  run_checks()


if __name__ == "__main__":
  main()
