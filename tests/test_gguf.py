"""GGUF files (models.gguf_io) written here as llama.cpp's converter writes
them, against an HF checkpoint of the same weights, transformers' PyTorch
model and the tokenizer they were made from."""

import json
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flax import nnx
import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from agentrl_jax import models
from agentrl_jax import tokenizer as T
from agentrl_jax.models import gguf_io

Q = gguf.GGMLQuantizationType
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Stored as in llama.cpp's Q4_1 files: the embedding Q8_0, projections Q4_1,
# norms F32; v_proj F16, the rest F32.
QTYPES = {"embed_tokens": Q.Q8_0, "q_proj": Q.Q4_1, "k_proj": Q.Q4_1,
          "gate_proj": Q.Q4_1, "v_proj": Q.F16}
ROPE = {"rope_type": "default", "rope_theta": 1e5}


def _hf_config(arch, rope=ROPE):
  cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
         "qwen3": transformers.Qwen3Config}[arch]
  # Qwen3's heads are 32 wide (4 x 32 != 64) and its head is untied.
  return cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2,
             head_dim=32 if arch == "qwen3" else 16, rms_norm_eps=1e-5,
             max_position_embeddings=16384, tie_word_embeddings=arch != "qwen3",
             rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _weights(hf, seed=0):
  """HF-named float32 weights; norms around 1, Qwen2's biases nonzero."""
  rng = np.random.default_rng(seed)
  h, d, i = hf.hidden_size, hf.head_dim, hf.intermediate_size
  q, kv = hf.num_attention_heads * d, hf.num_key_value_heads * d
  shapes = {"model.embed_tokens.weight": (hf.vocab_size, h), "model.norm.weight": (h,)}
  if not hf.tie_word_embeddings:
    shapes["lm_head.weight"] = (hf.vocab_size, h)
  for layer in range(hf.num_hidden_layers):
    p = f"model.layers.{layer}."
    shapes.update({
        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i)})
    if hf.model_type == "qwen2":
      shapes.update({p + f"self_attn.{x}_proj.bias": (n,) for x, n in
                     (("q", q), ("k", kv), ("v", kv))})
    if hf.model_type == "qwen3":
      shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
  return {n: (1.0 if "norm" in n else 0.0) + rng.normal(0, 0.3 if "norm" in n else 0.15, s)
          .astype(np.float32) for n, s in shapes.items()}


def _qtype(name):
  return next((q for k, q in QTYPES.items() if f"{k}.weight" in name), Q.F32)


def _stored(weights):
  """What a file holds once loaded: each tensor through its storage type.
  Quantisation works on blocks within a row, so it commutes with
  llama.cpp's permutation of q/k rows: no permutation here."""
  out = {}
  for name, w in weights.items():
    qtype = _qtype(name)
    out[name] = (w if qtype == Q.F32 else
                 gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype))
  return out


def _llama_cpp_permute(w, n_head):
  # convert_hf_to_gguf.py's LlamaModel.permute.
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _write_gguf(path, hf, weights, *, arch=None, extra_tensors=(), rope_freqs=None,
                rope_scaling=None, chat_template=CHATML_TEMPLATE):
  """A GGUF file as convert_hf_to_gguf.py writes one, with llama.cpp's own
  tensor-name table and the bundled tokenizer's vocabulary."""
  arch = arch or hf.model_type
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(hf.num_hidden_layers)
  writer.add_context_length(hf.max_position_embeddings)
  writer.add_embedding_length(hf.hidden_size)
  writer.add_feed_forward_length(hf.intermediate_size)
  writer.add_head_count(hf.num_attention_heads)
  writer.add_head_count_kv(hf.num_key_value_heads)
  writer.add_key_length(hf.head_dim)
  writer.add_value_length(hf.head_dim)
  writer.add_rope_dimension_count(hf.head_dim)
  writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
  if rope_scaling:
    writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
    writer.add_rope_scaling_factor(rope_scaling[1])
  src = json.loads(T.load_tokenizer().backend_tokenizer.to_str())
  vocab = T.load_tokenizer().get_vocab()
  tokens = sorted(vocab, key=vocab.get)
  # llama.cpp's token types: 1 normal, 3 control (special), 4 user-defined.
  kinds = {t["content"]: 3 if t["special"] else 4 for t in src["added_tokens"]}
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_types([kinds.get(t, 1) for t in tokens])
  writer.add_token_merges([" ".join(m) for m in src["model"]["merges"]])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_pad_token_id(0)
  writer.add_add_bos_token(False)
  writer.add_chat_template(chat_template)
  names = gguf.get_tensor_name_map(
      next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == hf.model_type),
      hf.num_hidden_layers)
  heads = {"q_proj": hf.num_attention_heads, "k_proj": hf.num_key_value_heads}
  for name, w in weights.items():
    kind = name.split(".")[-2]
    if hf.model_type == "llama" and kind in heads:
      w = _llama_cpp_permute(w, heads[kind])
    qtype = _qtype(name)
    writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")),
                      gguf.quants.quantize(w, qtype), raw_dtype=qtype)
  if rope_freqs is not None:
    writer.add_tensor("rope_freqs.weight", rope_freqs)
  for name, data, qtype in extra_tensors:
    writer.add_tensor(name, data, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def _save_hf(path, hf, weights):
  path.mkdir()
  hf.save_pretrained(str(path))
  safetensors.numpy.save_file(weights, str(path / "model.safetensors"),
                              metadata={"format": "pt"})
  return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """arch -> (hf config, float weights, GGUF file, HF dir of the weights the
  file holds), each written once."""
  made = {}

  def get(arch):
    if arch not in made:
      hf = _hf_config(arch)
      weights = _weights(hf)
      tmp = tmp_path_factory.mktemp(arch)
      made[arch] = (hf, weights, _write_gguf(tmp / "model.gguf", hf, weights),
                    _save_hf(tmp / "hf", hf, _stored(weights)))
    return made[arch]
  return get


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def ckpt(request, checkpoints):
  return checkpoints(request.param)


@pytest.fixture
def llama(checkpoints):
  return checkpoints("llama")


def _tokens():
  return jnp.asarray(np.random.default_rng(1).integers(0, 512, (2, 12)))


def test_loads_as_the_hf_checkpoint_of_the_weights_it_holds(ckpt):
  hf, weights, gguf_path, hf_dir = ckpt
  model = models.from_pretrained(gguf_path)
  want = models.from_pretrained(hf_dir)
  assert model.cfg == want.cfg
  # F32 tensors are the originals; the others differ from them by the
  # storage type's error, and match dequantize(quantize(w)) exactly.
  stored = _stored(weights)
  for name, w in weights.items():
    err = np.abs(stored[name] - w).max()
    assert (err == 0) == (_qtype(name) == Q.F32) and err < 0.1 * np.abs(w).max(), name
  for (p1, v1), (p2, v2) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                nnx.to_flat_state(nnx.state(want, nnx.Param))):
    assert p1 == p2
    np.testing.assert_array_equal(v1.get_value(), v2.get_value(), err_msg=str(p1))
  got, ref = np.asarray(model(_tokens())), np.asarray(want(_tokens()))
  assert np.abs(ref).max() > 1.0, "logits too small to make the comparison bite"
  np.testing.assert_array_equal(got, ref)


def test_export_loads_in_transformers_with_equal_logits(llama, tmp_path):
  _, _, gguf_path, hf_dir = llama
  model = models.from_pretrained(gguf_path)
  out = models.save_pretrained(model, tmp_path / "export",
                               hf_config=gguf_io.hf_config(gguf_path))
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
  assert (exported.config.bos_token_id, exported.config.eos_token_id,
          exported.config.pad_token_id) == (1, 2, 0)
  tokens = _tokens()
  with torch.no_grad():
    want = reference(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
    got = exported(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()
  ours = np.asarray(model(tokens))
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 1e-6 * scale
  assert np.abs(ours - want).max() <= 1e-4 * scale


def test_tokenizer_and_chat_template_from_metadata(llama):
  _, _, gguf_path, _ = llama
  tok, src = T.load_tokenizer(gguf_path), T.load_tokenizer()
  assert tok.get_vocab() == src.get_vocab()
  for text in ("Hello world, 12 + 30 = 42!", "  héllo\tthere \n\n",
               "<|im_start|>user\n<search>x</search><|im_end|>"):
    ids = T.encode(tok, text)
    assert ids == T.encode(src, text)
    assert tok.decode(ids) == text
  assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
      "<|im_start|>", "<|im_end|>", "<|endoftext|>")
  assert tok("Hello")["input_ids"] == T.encode(src, "Hello")  # add_bos_token False
  assert set(tok.all_special_tokens) >= {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
  assert "<search>" not in tok.all_special_tokens
  rendered = tok.apply_chat_template(
      [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
      tokenize=False, add_generation_prompt=True)
  assert rendered == T.CHATML.prompt_text("Be brief.", "2+2?")


def test_directory_holding_one_gguf(llama, tmp_path):
  _, _, gguf_path, hf_dir = llama
  shutil.copy(gguf_path, tmp_path / "a.gguf")
  assert models.from_pretrained(tmp_path).cfg == models.from_pretrained(hf_dir).cfg
  assert T.load_tokenizer(tmp_path).chat_template == CHATML_TEMPLATE
  # Beside an HF checkpoint's files, the HF checkpoint loads.
  both = tmp_path / "both"
  shutil.copytree(hf_dir, both)
  shutil.copy(gguf_path, both / "b.gguf")
  (both / "config.json").write_text((both / "config.json").read_text().replace(
      '"rms_norm_eps": 1e-05', '"rms_norm_eps": 0.001'))
  assert models.from_pretrained(both).cfg.rms_norm_eps == 1e-3
  shutil.copy(gguf_path, tmp_path / "b.gguf")
  with pytest.raises(ValueError, match=r"2 GGUF files.*a\.gguf.*b\.gguf"):
    models.from_pretrained(tmp_path)
  with pytest.raises(ValueError, match="2 GGUF files"):
    T.load_tokenizer(tmp_path)


def test_unsupported_files_raise(tmp_path):
  hf = _hf_config("llama")
  weights = _weights(hf)
  with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'phi3'.*llama"):
    models.from_pretrained(_write_gguf(tmp_path / "phi.gguf", hf, weights, arch="phi3"))
  # Q8_1 is llama.cpp's in-memory activation type: gguf cannot dequantise it.
  fused = "blk.0.attn_qkv.weight"
  q81 = np.zeros((64, 64 // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)
  path = _write_gguf(tmp_path / "q81.gguf", hf, weights, extra_tensors=[(fused, q81, Q.Q8_1)])
  with pytest.raises(ValueError, match=rf"unsupported tensor types.*'{fused}': 'Q8_1'"):
    models.from_pretrained(path)
  path = _write_gguf(tmp_path / "fused.gguf", hf, weights,
                     extra_tensors=[(fused, np.zeros((64, 64), np.float32), Q.F32)])
  with pytest.raises(ValueError, match=rf"no llama counterpart.*{fused}"):
    models.from_pretrained(path)


def _llama3_factors(theta, dim, factor, low, high, old):
  # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, as written there.
  factors = []
  for k in range(0, dim, 2):
    wavelen = 2 * math.pi * theta ** (k / dim)
    if wavelen < old / high:
      factors.append(1.0)
    elif wavelen > old / low:
      factors.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(factors, np.float32)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
    # Head dim 16, base 5e5: wavelengths 6 ... 6e5, in all three bands.
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 5e5},
])
def test_rope_scaling_from_metadata(rope, tmp_path):
  hf = _hf_config("llama", rope)
  weights = _weights(hf)
  if rope["rope_type"] == "linear":
    path = _write_gguf(tmp_path / "m.gguf", hf, weights, rope_scaling=("linear", 4.0))
  else:
    path = _write_gguf(tmp_path / "m.gguf", hf, weights, rope_freqs=_llama3_factors(
        5e5, 16, 8.0, 1.0, 4.0, 8192))
  got = models.from_hf_config(gguf_io.hf_config(path))
  assert got == models.from_hf_config(hf)
  assert got.rope_type == rope["rope_type"]


def test_rope_table_of_other_llama3_parameters_raises(tmp_path):
  # low_freq_factor 2, not 1: the wavelength 4443 is scaled by 8, not smoothed.
  hf = _hf_config("llama", {"rope_type": "default", "rope_theta": 5e5})
  path = _write_gguf(tmp_path / "m.gguf", hf, _weights(hf),
                     rope_freqs=_llama3_factors(5e5, 16, 8.0, 2.0, 4.0, 8192))
  with pytest.raises(ValueError, match="rope_freqs.weight is not Llama 3 RoPE scaling"):
    gguf_io.hf_config(path)
