"""The NNX decoder against transformers' PyTorch Llama/Qwen2/Qwen3/Gemma 2/Gemma 3 on the
same weights."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from agentrl_jax import losses, models
from agentrl_jax.models import KVCache, decoder
from agentrl_jax.trajectory import attention_mask


def _hf_config(arch):
  common = dict(vocab_size=97, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, initializer_range=0.15)
  if arch == "llama":  # Llama-3 RoPE scaling, untied head
    return transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0})
  rope = {"rope_type": "default", "rope_theta": 1e6}
  # Gemma: a window of 8 (rows of 9-200 tokens), soft caps of 5 (both change
  # the logits by more than 1), scores scaled by 16**-0.5, not 24**-0.5.
  # No pad_token_id: torch's nn.Embedding would freeze the gradient of the
  # pad token's row (ours trains every row; padding never reaches a loss).
  gemma = dict(head_dim=24, query_pre_attn_scalar=16, sliding_window=8,
               final_logit_softcapping=5.0, pad_token_id=None)
  if arch == "gemma2":  # layers 0 sliding, 1 global
    return transformers.Gemma2Config(**common, **gemma, attn_logit_softcapping=5.0,
                                     rope_parameters=rope)
  if arch == "gemma3_text":  # local RoPE base 1e4, global 1e6 with linear scaling
    return transformers.Gemma3TextConfig(
        **common, **gemma, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1e6}})
  if arch == "qwen3":  # heads 24 wide, not 64 / 4; q/k norms; untied head
    return transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False,
                                    rope_parameters=rope)
  return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_parameters=rope)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma2", "gemma3_text"])
def checkpoint(request, tmp_path_factory):
  """(arch, torch model, local checkpoint dir) for a tiny random model."""
  torch.manual_seed(0)
  cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
         "qwen3": transformers.Qwen3ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM,
         "gemma3_text": transformers.Gemma3ForCausalLM}[request.param]
  model = cls(_hf_config(request.param)).eval()
  # HF initialises biases to 0 and norm weights to 1 (Gemma's to 0, it
  # scales by 1 + w): make them matter.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if request.param == "qwen2" and name.endswith("bias"):
        p.normal_(0, 0.5)
      if request.param == "qwen3" and "norm" in name:
        p.normal_(1, 0.5)
      if request.param.startswith("gemma") and "norm" in name:
        p.normal_(0, 0.5)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  return request.param, model, path


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 97, (3, 24))
  lengths = np.array([24, 17, 9])
  attn = (np.arange(24)[None] < lengths[:, None]).astype(np.int64)
  return tokens, attn


def _torch_logits(model, tokens, attn):
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens),
                 attention_mask=torch.tensor(attn)).logits.numpy()


def test_logits_match_transformers_with_padding(checkpoint):
  arch, tmodel, path = checkpoint
  model = models.from_pretrained(path)
  assert model.cfg.arch == arch
  tokens, attn = _batch()
  want = _torch_logits(tmodel, tokens, attn)
  got = np.asarray(model(jnp.asarray(tokens), None, jnp.asarray(np.where(attn > 0, 0, -1))))
  assert np.abs(want).max() > 1.0, "logits too small to make the comparison bite"
  np.testing.assert_array_less(np.abs(got - want)[attn > 0].max(), 1e-4)


def test_rows_long_enough_for_query_blocks_match_transformers(checkpoint):
  # 200 tokens train in 3 query blocks (edges 67, 133), each attending to
  # the keys up to its own end; padding and a packed row cross the edges.
  arch, tmodel, path = checkpoint
  model = models.from_pretrained(path)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 97, (3, 200))
  lengths = np.array([200, 131, 60])
  attn = (np.arange(200)[None] < lengths[:, None]).astype(np.int64)
  want = _torch_logits(tmodel, tokens, attn)
  got = np.asarray(model(jnp.asarray(tokens), None, jnp.asarray(np.where(attn > 0, 0, -1))))
  np.testing.assert_array_less(np.abs(got - want)[attn > 0].max(), 1e-4)
  # Row 1 packs its 131 tokens with the first 69 of row 2 (positions restart).
  packed = np.concatenate([tokens[1, :131], tokens[2, :69]])[None]
  positions = np.concatenate([np.arange(131), np.arange(69)])[None]
  seq_ids = np.repeat([0, 1], [131, 69])[None]
  got = np.asarray(model(jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(seq_ids)))[0]
  alone = _torch_logits(tmodel, tokens[2:, :69], np.ones((1, 69), np.int64))[0]
  np.testing.assert_array_less(np.abs(got[:131] - want[1, :131]).max(), 1e-4)
  np.testing.assert_array_less(np.abs(got[131:] - alone).max(), 1e-4)


def test_gradients_match_transformers_autograd(checkpoint):
  # Every parameter's gradient of a weighted log-likelihood against torch's
  # autograd: 200-token rows in 3 query blocks, padded, through the
  # hand-written attention backward.
  arch, tmodel, path = checkpoint
  model = models.from_pretrained(path)
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 97, (3, 200))
  attn = (np.arange(200)[None] < np.array([200, 131, 60])[:, None]).astype(np.int64)
  weights = rng.normal(size=(3, 199)) * attn[:, 1:]

  tmodel.zero_grad()
  logits = tmodel(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(attn)).logits
  lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(tokens[:, 1:, None]))[..., 0]
  (lp * torch.tensor(weights, dtype=torch.float32)).sum().backward()
  want = {n: p.grad.numpy() for n, p in tmodel.named_parameters()}

  def loss(m):
    lp = losses.token_logprobs(m(jnp.asarray(tokens), None,
                                 jnp.asarray(np.where(attn > 0, 0, -1))), jnp.asarray(tokens))
    return jnp.sum(lp[:, 1:] * weights)

  grads = nnx.to_flat_state(nnx.grad(loss)(model))
  assert len(grads) == len(want)
  for path, g in grads:
    name, transpose = models.hf_io._hf_name(path)
    g = np.asarray(g.get_value())
    w = want[name].T if transpose else want[name]
    scale = np.abs(w).max()
    assert scale > 1e-3, name
    np.testing.assert_array_less(np.abs(g - w).max() / scale, 1e-4, err_msg=name)


@pytest.mark.parametrize("denom, softcap", [(np.sqrt(8), None), (2.0, 1.5)])
def test_attention_backward_equals_autodiff_of_a_plain_reference(denom, softcap):
  # Random cotangents on every output, fully masked padding rows included:
  # their uniform softmax must pass no gradient (autodiff's select passes none).
  # With Gemma 2's soft cap (1.5, under most |scores|) and scale.
  rng = np.random.default_rng(3)
  b, kv, g, l, d = 2, 2, 3, 40, 8
  q, dout = (jnp.asarray(rng.normal(size=(b, kv, g, l, d)), jnp.float32) for _ in range(2))
  k, v = (jnp.asarray(rng.normal(size=(b, kv, l, d)), jnp.float32) for _ in range(2))
  seq_ids = jnp.asarray(np.stack([np.repeat([0, 1, -1], [15, 20, 5]), np.zeros(l, int)]))
  mask = attention_mask(seq_ids)
  assert not np.asarray(mask)[0, -1].any()  # a fully masked row

  def reference(q, k, v):
    scores = jnp.einsum("bkgld,bksd->bkgls", q, k) / denom
    if softcap is not None:
      scores = softcap * jnp.tanh(scores / softcap)
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -1e30), -1)
    return jnp.einsum("bkgls,bksd->bkgld", probs, v)

  def vjp(f):
    out, pull = jax.vjp(f, q, k, v)
    return out, pull(dout)

  (out, grads), (want_out, want) = (
      vjp(lambda *x: decoder._attend(*x, mask, denom, softcap)), vjp(reference))
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  for got, ref in zip(grads, want):
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_packed_row_equals_separate_rows(checkpoint):
  _, _, path = checkpoint
  model = models.from_pretrained(path)
  tokens, _ = _batch()
  a, b = tokens[0, :10], tokens[1, :14]
  separate = [np.asarray(model(jnp.asarray(x[None])))[0] for x in (a, b)]
  packed = jnp.asarray(np.concatenate([a, b])[None])
  positions = jnp.asarray(np.concatenate([np.arange(10), np.arange(14)])[None])
  seq_ids = jnp.asarray(np.repeat([0, 1], [10, 14])[None])
  got = np.asarray(model(packed, positions, seq_ids))[0]
  np.testing.assert_allclose(got[:10], separate[0], atol=2e-5)
  np.testing.assert_allclose(got[10:], separate[1], atol=2e-5)


def test_kv_cache_forward_equals_full_forward_token_by_token(checkpoint):
  _, tmodel, path = checkpoint
  model = models.from_pretrained(path)
  tokens, _ = _batch()
  tokens = jnp.asarray(tokens[:2, :20])
  full = np.asarray(model(tokens))
  want = _torch_logits(tmodel, np.asarray(tokens), np.ones((2, 20), np.int64))
  np.testing.assert_array_less(np.abs(full - want).max(), 1e-4)
  step = nnx.jit(lambda m, t, p, c: m.hidden_states(t, p, cache=c))
  cache = KVCache.zeros(model.cfg, 2, 32)
  # Prefill 8 tokens, then one token at a time; the last prefill chunk is
  # ragged: slot 1 pads its chunk with positions >= S, which are dropped.
  hidden, cache = step(model, tokens[:, :8], jnp.broadcast_to(jnp.arange(8), (2, 8)), cache)
  np.testing.assert_allclose(model.logits(hidden), full[:, :8], atol=2e-5)
  for i in range(8, 20):
    hidden, cache = step(model, tokens[:, i:i + 1], jnp.full((2, 1), i), cache)
    np.testing.assert_allclose(np.asarray(model.logits(hidden))[:, 0], full[:, i],
                               atol=2e-5)


def test_cache_ignores_parked_padding_and_stale_entries(checkpoint):
  _, _, path = checkpoint
  model = models.from_pretrained(path)
  tokens, _ = _batch()
  tokens = jnp.asarray(tokens[:1, :12])
  full = np.asarray(model(tokens))
  # Garbage left in the cache by an earlier episode of the slot...
  cache = KVCache.zeros(model.cfg, 1, 16)
  _, cache = model.hidden_states(jnp.full((1, 16), 5), jnp.arange(16)[None], cache=cache)
  # ...and a prefill chunk padded to 12 with parked positions (>= S = 16).
  chunk = tokens.at[0, 9:].set(0)
  positions = jnp.asarray([list(range(9)) + [16, 17, 18]])
  hidden, cache = model.hidden_states(chunk, positions, cache=cache)
  np.testing.assert_allclose(model.logits(hidden)[0, :9], full[0, :9], atol=2e-5)
  hidden, _ = model.hidden_states(tokens[:, 9:], jnp.asarray([[9, 10, 11]]), cache=cache)
  np.testing.assert_allclose(model.logits(hidden)[0], full[0, 9:], atol=2e-5)


def test_export_round_trips_bit_exactly_and_loads_in_transformers(checkpoint, tmp_path):
  arch, _, path = checkpoint
  model = models.from_pretrained(path)
  out = models.save_pretrained(
      model, tmp_path / "export",
      hf_config=transformers.AutoConfig.from_pretrained(path))
  again = models.from_pretrained(out)
  for (p1, v1), (p2, v2) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                nnx.to_flat_state(nnx.state(again, nnx.Param))):
    assert p1 == p2
    np.testing.assert_array_equal(v1.get_value(), v2.get_value())
  tmodel = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(tmodel).__name__.lower().startswith(arch.removesuffix("_text"))
  tokens, attn = _batch()
  want = np.asarray(model(jnp.asarray(tokens), None, jnp.asarray(np.where(attn > 0, 0, -1))))
  got = _torch_logits(tmodel, tokens, attn)
  np.testing.assert_array_less(np.abs(got - want)[attn > 0].max(), 1e-4)


def test_sharded_checkpoint_loads(checkpoint, tmp_path):
  _, tmodel, path = checkpoint
  tmodel.save_pretrained(tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  a, b = models.from_pretrained(path), models.from_pretrained(tmp_path)
  tokens = jnp.asarray(_batch()[0])
  np.testing.assert_array_equal(a(tokens), b(tokens))


def test_bf16_activations_over_float32_masters(checkpoint):
  # A bf16-compute model trains float32 weights (the checkpoint's values
  # exactly) and casts them to bf16 inside each layer: its logits equal
  # those of bf16-stored weights, bit for bit.
  _, tmodel, path = checkpoint
  model = models.from_pretrained(path, dtype=jnp.bfloat16)
  stored16 = models.from_pretrained(path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  f32 = models.from_pretrained(path)
  for path_, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    assert leaf.get_value().dtype == jnp.float32, path_
  assert stored16.embed_tokens.embedding.get_value().dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(model.embed_tokens.embedding.get_value()),
                                tmodel.model.embed_tokens.weight.detach().numpy())
  tokens = jnp.asarray(_batch()[0])
  logits = model(tokens)
  assert logits.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(logits, np.float32),
                                np.asarray(stored16(tokens), np.float32))
  lp16 = losses.token_logprobs(logits, tokens)
  lp32 = losses.token_logprobs(f32(tokens), tokens)
  assert lp16.dtype == jnp.float32
  np.testing.assert_allclose(lp16, lp32, atol=0.15)


# -- Loading errors ------------------------------------------------------------------

def test_load_errors_are_clear(checkpoint, tmp_path):
  _, tmodel, path = checkpoint
  with pytest.raises(FileNotFoundError, match="no config.json"):
    models.from_pretrained(tmp_path / "nowhere")
  tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
  config = (path / "config.json").read_text()

  def write(name, tensors, config=config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(config)
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    return d

  missing = dict(tensors)
  del missing["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(ValueError, match=r"missing tensors \(1\): \['model.layers.1.mlp.up_proj.weight'\]"):
    models.from_pretrained(write("missing", missing))
  extra = dict(tensors, **{"model.layers.0.mlp.up_proj.bias": np.zeros(128, np.float32)})
  with pytest.raises(ValueError, match=r"unexpected tensors \(1\)"):
    models.from_pretrained(write("extra", extra))
  bad = dict(tensors, **{"model.norm.weight": np.ones(3, np.float32)})
  with pytest.raises(ValueError, match="model.norm.weight has shape"):
    models.from_pretrained(write("shape", bad))
  gpt2 = json.loads(config)
  gpt2["model_type"] = "gpt2"
  with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
    models.from_pretrained(write("gpt2", tensors, json.dumps(gpt2)))
  (tmp_path / "noweights").mkdir()
  (tmp_path / "noweights" / "config.json").write_text(config)
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    models.from_pretrained(tmp_path / "noweights")


# -- Value head, remat ------------------------------------------------------------------------

def test_value_head_round_trip(checkpoint, tmp_path):
  _, _, path = checkpoint
  model = models.from_pretrained(path, value_head=True, seed=3)
  tokens = jnp.asarray(_batch()[0])
  hidden, _ = model.hidden_states(tokens, jnp.broadcast_to(jnp.arange(24), (3, 24)))
  values = model.values(hidden)
  assert values.shape == (3, 24) and values.dtype == jnp.float32
  models.save_pretrained(model, tmp_path)
  again = models.from_pretrained(tmp_path, value_head=True, seed=99)
  np.testing.assert_array_equal(again.values(hidden), values)
  with pytest.raises(ValueError, match="no value head"):
    models.from_pretrained(path).values(hidden)


def test_remat_gives_the_same_gradients():
  cfg = models.tiny_config("qwen2", vocab_size=97, num_layers=2)
  tokens = jnp.asarray(_batch()[0])

  def grads(remat):
    model = models.Decoder(cfg.replace(remat=remat), rngs=nnx.Rngs(0))
    loss = lambda m: losses.token_logprobs(m(tokens), tokens).sum()
    return nnx.grad(loss)(model)

  for a, b in zip(jax.tree.leaves(grads(False)), jax.tree.leaves(grads(True))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_remat_keeps_only_layer_inputs_for_the_backward_pass():
  # XLA's buffer assignment for the gradient (nothing is allocated): per
  # layer, plain layers keep their activations ([T, F] MLP and [T, S]
  # attention buffers); remat keeps the layer input [T, d] and recomputes.
  # jax.checkpoint over these unrolled layers saved nothing on XLA:CPU.
  cfg = models.tiny_config("qwen2", vocab_size=97, hidden_size=64, intermediate_size=512)
  tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)

  def temp_bytes(layers, remat):
    model = nnx.eval_shape(lambda: models.Decoder(
        cfg.replace(num_layers=layers, remat=remat), rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    loss = lambda p, t: nnx.merge(graphdef, p)(t).astype(jnp.float32).sum()
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  per_layer = {remat: (temp_bytes(4, remat) - temp_bytes(2, remat)) / 2
               for remat in (False, True)}
  layer_input = 4 * 256 * 64 * 4  # [B, L, d] float32
  assert per_layer[False] > 8 * layer_input  # activations dominate without remat
  assert per_layer[True] <= 2 * layer_input, per_layer


def test_remat_casts_one_layers_weights_at_a_time():
  # bf16 compute over float32 masters, gradients summed over micro-batches
  # (the train step's lax.scan). Without `decoder.after`, XLA hoists every
  # layer's bf16 weight cast (and XLA:CPU's float32 copy of it for its dots)
  # out of the loop and shares it with the backward pass: the temporaries
  # then grow by those copies with every layer. Under remat each layer casts
  # where it runs, so they grow by far less than one layer's bf16 weights.
  cfg = models.tiny_config("qwen2", vocab_size=97, hidden_size=128, intermediate_size=2048,
                           dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=True)
  tokens = jax.ShapeDtypeStruct((4, 1, 8), jnp.int32)

  def temp_bytes(layers):
    model = nnx.eval_shape(lambda: models.Decoder(cfg.replace(num_layers=layers),
                                                  rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)

    def summed_grads(p, micro):
      loss = lambda p, t: nnx.merge(graphdef, p)(t).astype(jnp.float32).sum()
      def body(acc, t):
        return jax.tree.map(jnp.add, acc, jax.grad(loss)(p, t)), None
      return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), micro)[0]

    compiled = jax.jit(summed_grads).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  per_layer = (temp_bytes(4) - temp_bytes(2)) / 2
  layer_bf16 = 3 * 128 * 2048 * 2  # the MLP's three matrices in bf16
  # The summed gradients are float32 per layer (2x layer_bf16) and are outputs,
  # not temporaries; what grows is what stays alive across layers.
  assert per_layer <= layer_bf16 / 2, (per_layer, layer_bf16)


def test_config_round_trip_through_hf():
  for arch in models.SUPPORTED_ARCHS:
    cfg = models.tiny_config(arch, rope_type="llama3", rope_factor=8.0)
    assert models.from_hf_config(models.to_hf_config(cfg)) == cfg
  assert models.tiny_config("qwen3").head_dim * 4 != models.tiny_config("qwen3").hidden_size
  with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
    models.tiny_config(rope_type="yarn")
  with pytest.raises(ValueError, match="Qwen3 always has q/k norms"):
    models.to_hf_config(models.tiny_config("qwen3", qk_norm=False))
  with pytest.raises(ValueError, match="Qwen3 always has q/k norms"):
    models.to_hf_config(models.tiny_config("llama", qk_norm=True))
  # Sliding-window layers are not modelled: refused, never silently full attention.
  sliding = transformers.Qwen3Config(**_hf_config("qwen3").to_dict() | dict(
      use_sliding_window=True, sliding_window=16, max_window_layers=1))
  with pytest.raises(ValueError, match="use_sliding_window=True"):
    models.from_hf_config(sliding)



def test_gemma_config_conversion_and_refusals():
  # transformers' default layer patterns: Gemma 2 alternates from a sliding
  # layer 0; Gemma 3 has five sliding layers per global one.
  hf2 = transformers.Gemma2Config(num_hidden_layers=4)
  cfg2 = models.from_hf_config(hf2)
  assert cfg2.sliding_layers == (True, False, True, False)
  assert (cfg2.sliding_window, cfg2.attn_logit_softcap, cfg2.final_logit_softcap) == (
      4096, 50.0, 30.0)
  cfg3 = models.from_hf_config(transformers.Gemma3TextConfig(num_hidden_layers=12))
  assert [i for i in range(12) if not cfg3.is_sliding(i)] == [5, 11]
  assert (cfg3.rope_theta, cfg3.rope_local_theta, cfg3.qk_norm) == (1e6, 1e4, True)
  assert models.from_hf_config(models.to_hf_config(cfg3)) == cfg3
  refused = {
      "never applies it": transformers.Gemma3TextConfig(attn_logit_softcapping=50.0),
      "use_bidirectional_attention": transformers.Gemma3TextConfig(
          use_bidirectional_attention=True),
      "unsupported hidden activation 'gelu'": transformers.Gemma2Config(
          hidden_activation="gelu"),
      "rope type 'linear' on sliding": transformers.Gemma3TextConfig(rope_parameters={
          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
      "multimodal Gemma 3": transformers.Gemma3Config(),
  }
  for message, hf in refused.items():
    with pytest.raises(ValueError, match=message):
      models.from_hf_config(hf)
  with pytest.raises(ValueError, match=r"\['sliding_window', 'sliding_layers'\] have no llama"):
    models.to_hf_config(models.tiny_config("llama", sliding_window=8,
                                           sliding_layers=(True, False)))
  with pytest.raises(ValueError, match="gemma3_text needs rope_local_theta"):
    models.to_hf_config(models.tiny_config("gemma3_text", rope_local_theta=None))
  with pytest.raises(ValueError, match="sliding layers need a sliding_window"):
    models.tiny_config("gemma2", sliding_window=None)
  with pytest.raises(ValueError, match="sliding_layers has 1 entries for 2 layers"):
    models.tiny_config("gemma2", sliding_layers=(True,))


def test_gemma_embedding_scale_rounds_in_the_activation_dtype():
  # sqrt(48) = 6.93 is 6.9375 in bf16: transformers multiplies bf16 rows by
  # that, not by the float32 value (which would round each product differently).
  torch.manual_seed(0)
  hf = transformers.Gemma2Config(vocab_size=97, hidden_size=48, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=24, pad_token_id=None)
  tmodel = transformers.Gemma2ForCausalLM(hf).to(torch.bfloat16)
  model = models.Decoder(models.from_hf_config(hf, dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
  table = tmodel.model.embed_tokens.weight.detach().float().numpy()
  model.embed_tokens.embedding.set_value(jnp.asarray(table))
  ids = np.arange(97)[None]
  with torch.no_grad():
    want = tmodel.model.embed_tokens(torch.tensor(ids)).float().numpy()
  got = np.asarray(model.embed(jnp.asarray(ids)), np.float32)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(want, (table[ids] * np.sqrt(48)).astype(jnp.bfloat16).astype(np.float32))
