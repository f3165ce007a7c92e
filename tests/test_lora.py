"""LoRA (models/lora.py): only adapters train, the sampler follows them,
adapter checkpoints resume exactly, an adapted model exports merged (what
transformers then runs is the adapted model)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

from agentrl_jax import models, train
from agentrl_jax.checkpointing import Checkpointer
from agentrl_jax.checks import FieldError
from agentrl_jax.sampling import Sampler
from agentrl_jax.train import step as step_lib
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate
from test_train_step import _batch

LORA = models.LoraConfig(rank=4, alpha=8.0)


def _model(remat=False, lora=LORA, dtype=jnp.float32):
  """The tiny model (value head included) with adapters: a fresh one per
  call, always with the same base and adapters."""
  cfg = models.tiny_config("qwen2", vocab_size=64, value_head=True, remat=remat, dtype=dtype)
  return models.add_adapters(models.Decoder(cfg, rngs=nnx.Rngs(0)), lora, nnx.Rngs(1))


def _leaves(tree):
  return {jax.tree_util.keystr(p): np.asarray(x, np.float32)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _rl_steps(model, steps=2, tx=None, **loss):
  tx = tx or optax.adam(1e-2)
  graphdef, state = train.init_train_state(model, tx, with_reference=True)
  step = train.RLStep(graphdef, tx, train.LossConfig(kl_beta=0.05, value_coef=0.5, **loss))
  for _ in range(steps):
    state, metrics = step(state, _batch(1))
  return graphdef, state, metrics


def test_config_rules():
  with pytest.raises(FieldError, match="rank = -1 must be >= 0"):
    models.LoraConfig(rank=-1)
  with pytest.raises(FieldError, match="alpha = 0.0 must be > 0"):
    models.LoraConfig(alpha=0.0)
  with pytest.raises(FieldError, match=r"unknown: \['qkv'\]"):
    models.LoraConfig(target_modules=("q_proj", "qkv"))
  with pytest.raises(FieldError, match="target_modules"):
    models.LoraConfig(target_modules=())


def test_adapters_start_as_the_base_on_the_targets_only():
  plain = models.Decoder(models.tiny_config("qwen2", vocab_size=64, value_head=True),
                         rngs=nnx.Rngs(0))
  model = _model(lora=models.LoraConfig(rank=4, target_modules=("v_proj", "up_proj")))
  adapted = {p[-3] for p, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  assert adapted == {"v_proj", "up_proj"}
  # B = 0: the same function; the base's weights are the plain model's.
  tokens = jnp.arange(24)[None] % 64
  np.testing.assert_array_equal(model(tokens), plain(tokens))
  base = nnx.state(model, nnx.Not(nnx.LoRAParam))
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(nnx.state(plain, nnx.Param))):
    np.testing.assert_array_equal(a, b)


def test_a_lora_step_changes_only_the_adapters_and_the_value_head():
  model = _model()
  base = _leaves(nnx.state(model, nnx.Not(models.lora.TRAINABLE)))
  start = _leaves(nnx.state(model, models.lora.TRAINABLE))
  graphdef, state, metrics = _rl_steps(model)
  assert int(state.step) == 2 and float(metrics["kl_k3_grad_forward"]) > 0
  # The base: bit for bit as it was (the state's frozen copy, float32 here).
  frozen = _leaves(state.frozen)
  assert frozen.keys() == base.keys() and len(base) > 20
  for k in base:
    np.testing.assert_array_equal(frozen[k], base[k])
  # The trained set is the adapters and the value head, and all of it moved.
  trained = _leaves(state.params)
  assert trained.keys() == start.keys()
  assert all("lora" in k or "value_head" in k for k in trained)
  assert all(np.abs(trained[k] - start[k]).max() > 0 for k in trained
             if not k.endswith("lora_a')]"))  # A moves once B is off zero
  # AdamW's moments exist for the trained set alone.
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert sum(x.size for x in moments) == 2 * sum(x.size for x in trained.values())
  # The KL reference is the model at the start: base + the adapters it started with.
  np.testing.assert_array_equal(
      np.concatenate([x.ravel() for x in _leaves(state.ref_params).values()]),
      np.concatenate([x.ravel() for x in start.values()]))


def test_a_remat_model_takes_the_same_lora_step():
  # Adapters inside the remat layers get their gradients from the recomputed
  # forward (an interception-based LoRA gave them none there).
  # (SGD: Adam's normalised update would magnify rounding on near-zero gradients.)
  _, plain, m1 = _rl_steps(_model(), tx=optax.sgd(1.0))
  _, remat, m2 = _rl_steps(_model(remat=True), tx=optax.sgd(1.0))
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(remat.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)


def _rollout(sampler, prompts, n=12):
  """One sampled turn per prompt, as a batch with the sampler's log-probs."""
  slots = list(range(len(prompts)))
  state = sampler.prefill(sampler.init_state(seed=3), slots, prompts)
  _, actions = sampler.decode(state, slots, max_new_tokens=[n] * len(slots),
                              temperature=[1.0] * len(slots))
  return collate([Trajectory([Segment(Role.SYSTEM, p),
                              Segment(Role.ASSISTANT, actions[s].tokens,
                                      actions[s].raw_logprobs)])
                  for s, p in zip(slots, prompts)], buckets=(32,))


def test_the_sampler_runs_the_adapters_of_the_last_update():
  model = _model()
  sampler = Sampler(model, num_slots=4, cache_length=48, max_decode_length=12,
                    length_buckets=(8, 16))
  graphdef, state, _ = _rl_steps(model)  # the update moved the adapters
  sampler.update_params(state.model_params)  # the weight sync
  rng = np.random.default_rng(0)
  batch = _rollout(sampler, [list(rng.integers(0, 64, n)) for n in (5, 9, 3, 7)])
  on = batch.loss_mask > 0
  trainer = lambda params: np.asarray(step_lib.action_logprobs(
      graphdef, params, batch, 32, chunk=1024))[on]
  np.testing.assert_allclose(batch.old_logprobs[on], trainer(state.model_params), atol=1e-5)
  # The sampler's log-probs are not the adapters' before the update.
  _, start = train.init_train_state(model, optax.adam(1e-2), with_reference=False)
  assert np.abs(batch.old_logprobs[on] - trainer(start.model_params)).max() > 1e-2


def test_resume_from_an_adapter_checkpoint_is_exact(tmp_path):
  def begin():
    tx = optax.adam(1e-2)
    graphdef, state = train.init_train_state(_model(), tx, with_reference=False)
    return train.SFTStep(graphdef, tx), state

  step, state = begin()
  for i in range(2):
    state, _ = step(state, _batch(i))
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, train.checkpointed(state))
    fresh_step, fresh = begin()  # the base rebuilt from its seed
    restored, _ = ckpt.restore(abstract_state=jax.eval_shape(
        lambda: train.checkpointed(fresh)))
  resumed = restored.replace(frozen=fresh.frozen)
  (state, m1), (resumed, m2) = step(state, _batch(2)), fresh_step(resumed, _batch(2))
  assert jax.tree.structure(state) == jax.tree.structure(resumed)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(a, b)
  assert {k: float(v) for k, v in m1.items()} == {k: float(v) for k, v in m2.items()}
  # On disk: the adapters, the value head and their moments, not the base.
  # The array data only: orbax's metadata grows with the path it is saved
  # under (pytest-xdist's are longer).
  saved = sum(f.stat().st_size for f in tmp_path.rglob("ocdbt.process_*/d/*"))
  assert 0 < saved < sum(x.nbytes for x in jax.tree.leaves(state.frozen)) / 4


def test_an_adapted_models_export_is_the_merged_model_in_transformers(tmp_path):
  model = _model()
  lora = nnx.state(model, nnx.LoRAParam)
  nnx.update(model, jax.tree.map(  # adapters away from their start (B = 0)
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(x.size), x.shape), lora))
  merged = models.lora.merge(model)
  assert not models.lora.has_adapters(merged) and models.lora.has_adapters(model)
  tokens = jnp.arange(40)[None] % 64
  want = np.asarray(model(tokens))
  scale = np.abs(want).max()
  assert np.abs(want - np.asarray(models.Decoder(model.cfg, rngs=nnx.Rngs(0))(tokens))
                ).max() > 0.1 * scale  # the adapters matter
  np.testing.assert_allclose(np.asarray(merged(tokens)), want, atol=1e-5)
  # The adapted model itself exports: the merged weights, which our loader
  # takes back bit for bit and transformers runs as the adapted model.
  out = models.save_pretrained(model, tmp_path / "hf")
  again = models.from_pretrained(out, value_head=True)
  np.testing.assert_array_equal(np.asarray(again(tokens)), np.asarray(merged(tokens)))
  tmodel = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    got = tmodel(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
  assert np.abs(got - want).max() < 1e-4 * scale
