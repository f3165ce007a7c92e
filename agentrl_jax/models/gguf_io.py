"""GGUF checkpoints (llama.cpp's one-file format) in, without torch.

`from_gguf(path)`, also reached through `models.from_pretrained` for a `.gguf`
file or a directory holding one and no config.json, loads a Llama, Qwen2 or
Qwen3 file: `read_gguf` dequantises every tensor to float32 with the `gguf`
package (F16, BF16, Q4_0 ... Q8_0, the K- and I-quants: whatever
`gguf.quants.dequantize` knows), renames it to transformers' name
(`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`) and
builds a transformers config from the metadata (`hf_config`), so
`hf_io.from_tensors` checks shapes and transposes as for a safetensors
checkpoint. llama.cpp's converter permutes the rows of Llama's q/k
projections (`unpermute` undoes it); it stores Qwen's as they are. Gemma
files are refused: their sliding-window pattern and attention scale are
llama.cpp constants, not metadata. `load_gguf_tokenizer` builds the fast
tokenizer, chat template and special tokens from the metadata.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from agentrl_jax.models import config as config_lib
from agentrl_jax.models import decoder
from agentrl_jax.models import hf_io

# GGUF `general.architecture` -> transformers config class.
ARCHS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
# GGUF tensor names (llama.cpp's gguf-py/gguf/tensor_mapping.py) -> HF names.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {  # under blk.{i} / model.layers.{i}
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Llama 3 RoPE scaling as a per-frequency divisor table, not metadata.
_ROPE_FREQS = "rope_freqs.weight"
_REQUIRED = object()
# A directory with these beside a .gguf is an HF checkpoint / tokenizer.
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def find_gguf(path: str | os.PathLike,
              hf_files: tuple[str, ...] = MODEL_FILES) -> pathlib.Path | None:
  """The GGUF file `path` names: itself if it is a `.gguf` file, or the only
  `.gguf` in a directory holding none of `hf_files` (those make it an HF
  checkpoint); None if neither. Several candidates raise a ValueError."""
  path = pathlib.Path(path)
  if path.is_file():
    return path if path.suffix == ".gguf" else None
  if not path.is_dir() or any((path / f).exists() for f in hf_files):
    return None
  found = sorted(path.glob("*.gguf"))
  if len(found) > 1:
    raise ValueError(f"{path} holds {len(found)} GGUF files, name one: "
                     f"{[f.name for f in found]}")
  return found[0] if found else None


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's row permutation of a Llama q/k projection.

  HF's Llama rotates the halves of each head (x_j, x_{j + D/2}); GGML's
  "normal" RoPE rotates adjacent pairs (x_2j, x_2j+1). So convert_hf_to_gguf.py
  stores head h's row j at h*D + 2j and row j + D/2 at h*D + 2j + 1 (its
  `permute`: reshape [H, 2, D/2, ...], swap axes 1 and 2).

  Args:
    w: [n_heads * D, ...] a weight [out, in] or a bias [out] as stored.
    n_heads: query heads for q, KV heads for k.
  Returns:
    w in HF's row order, same shape.
  """
  rows = w.shape[0]
  return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  meta = {}
  for key, field in reader.fields.items():
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
      value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
    meta[key] = value
  return meta


def _shape(info) -> tuple[int, ...]:
  """A tensor's shape in torch order ([out, in]; GGML lists it reversed)."""
  return tuple(int(d) for d in reversed(info.shape))


def _rope_parameters(meta: dict, arch: str, infos: dict, head_dim: int) -> dict:
  """transformers' `rope_parameters` from the metadata (and Llama 3's table)."""
  theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
  kind = meta.get(f"{arch}.rope.scaling.type", "none")
  if _ROPE_FREQS in infos:
    table = gguf.quants.dequantize(infos[_ROPE_FREQS].data,
                                   infos[_ROPE_FREQS].tensor_type).reshape(-1)
    if np.allclose(table, 1.0):
      return {"rope_type": "default", "rope_theta": theta}
    # The table holds default / scaled frequencies; llama.cpp's converter
    # writes it for Llama 3 scaling, from parameters it does not store.
    # Llama 3.1-3.3 all use low 1, high 4 over 8192 positions: check that.
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": float(table.max()),
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(meta.get(
                f"{arch}.rope.scaling.original_context_length", 8192))}
    probe = config_lib.ModelConfig(
        arch="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
        rope_theta=theta, rope_type="llama3", rope_factor=rope["factor"],
        rope_original_max_positions=rope["original_max_position_embeddings"])
    ours = (decoder.rope_inv_freq(probe.replace(rope_type="default"))
            / decoder.rope_inv_freq(probe))
    if table.shape != ours.shape or not np.allclose(table, ours, rtol=1e-5):
      raise ValueError(f"{_ROPE_FREQS} is not Llama 3 RoPE scaling with {rope}; "
                       "unsupported")
    return rope
  if kind == "none":
    return {"rope_type": "default", "rope_theta": theta}
  if kind == "linear":
    return {"rope_type": "linear", "rope_theta": theta,
            "factor": float(meta[f"{arch}.rope.scaling.factor"])}
  raise ValueError(f"unsupported RoPE scaling {kind!r}; supported: none, linear, "
                   "llama3 (a rope_freqs table)")


def _hf_config(meta: dict, infos: dict, source):
  import transformers  # pylint: disable=g-import-not-at-top

  arch = meta.get("general.architecture")
  if arch not in ARCHS:
    raise ValueError(f"{source}: unsupported GGUF architecture {arch!r}; "
                     f"supported: {sorted(ARCHS)}")

  def get(key, default=_REQUIRED):
    value = meta.get(f"{arch}.{key}", default)
    if value is _REQUIRED:
      raise ValueError(f"{source} has no metadata {arch}.{key}")
    if isinstance(value, list):  # per-layer values (mixed-attention models)
      raise ValueError(f"{source}: per-layer {arch}.{key} is unsupported")
    return value

  heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
  head_dim = int(get("attention.key_length", hidden // heads))
  if int(get("attention.value_length", head_dim)) != head_dim:
    raise ValueError(f"{source}: value heads wider than key heads are unsupported")
  if int(get("rope.dimension_count", head_dim)) != head_dim:
    raise ValueError(f"{source}: RoPE on part of each head is unsupported")
  tokens = meta.get("tokenizer.ggml.tokens", ())
  fields = dict(
      vocab_size=_shape(infos["token_embd.weight"])[0] if "token_embd.weight" in infos
      else len(tokens),
      hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
      num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
      num_key_value_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
      max_position_embeddings=int(get("context_length")),
      rope_parameters=_rope_parameters(meta, arch, infos, head_dim),
      # llama.cpp writes no output.weight for a tied head.
      tie_word_embeddings="output.weight" not in infos,
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
      pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
  if arch == "llama":
    fields["attention_bias"] = "blk.0.attn_q.bias" in infos
  hf = getattr(transformers, ARCHS[arch])(**fields)
  hf.architectures = [ARCHS[arch].replace("Config", "ForCausalLM")]
  return hf


def _hf_name(name: str) -> str | None:
  parts = name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
  if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
    return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
  return None


def _dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
  """Does `gguf.quants.dequantize` read this type? (Tried on one zero block.)"""
  if qtype not in gguf.GGML_QUANT_SIZES:
    return False
  _, type_size = gguf.GGML_QUANT_SIZES[qtype]
  try:
    gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
  except (NotImplementedError, ValueError, TypeError):
    return False
  return True


def hf_config(path: str | os.PathLike):
  """The transformers config a GGUF file's metadata describes (with its
  bos/eos/pad ids): pass it to `models.save_pretrained(..., hf_config=)`."""
  reader = gguf.GGUFReader(str(path))
  return _hf_config(_metadata(reader), {t.name: t for t in reader.tensors}, path)


def read_gguf(path: str | os.PathLike) -> tuple[Any, dict[str, np.ndarray]]:
  """(transformers config, {HF name: float32 [out, in] tensor}) of a GGUF file,
  Llama's q/k rows back in HF's order (`unpermute`).

  Raises:
    ValueError: unsupported architecture, RoPE scaling or tensor type, or a
      tensor name with no HF counterpart (the message lists them).
  """
  reader = gguf.GGUFReader(str(path))
  infos = {t.name: t for t in reader.tensors}
  hf = _hf_config(_metadata(reader), infos, path)
  readable = {q: _dequantizable(q) for q in {t.tensor_type for t in infos.values()}}
  bad = {n: t.tensor_type.name for n, t in infos.items() if not readable[t.tensor_type]}
  if bad:
    raise ValueError(f"{path}: unsupported tensor types {bad}; supported: F32, F16, "
                     "BF16 and the quantisations gguf.quants.dequantize reads")
  unknown = sorted(n for n in infos if n != _ROPE_FREQS and _hf_name(n) is None)
  if unknown:
    raise ValueError(f"{path}: GGUF tensors with no {hf.model_type} counterpart: {unknown}")
  heads = {"attn_q": hf.num_attention_heads, "attn_k": hf.num_key_value_heads}
  tensors = {}
  for name, info in infos.items():
    if name == _ROPE_FREQS:
      continue  # in the config's rope_parameters
    w = gguf.quants.dequantize(info.data, info.tensor_type)
    w = np.asarray(w, np.float32).reshape(_shape(info))
    kind = name.split(".")[2] if name.startswith("blk.") else ""
    if hf.model_type == "llama" and kind in heads:
      w = unpermute(w, heads[kind])
    tensors[_hf_name(name)] = w
  return hf, tensors


def from_gguf(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32,
              value_head: bool = False, remat: bool = False,
              seed: int = 0) -> decoder.Decoder:
  """Loads a Llama/Qwen2/Qwen3 GGUF file (or a directory holding one) as a
  `Decoder`; arguments as `hf_io.from_pretrained`. Quantised tensors are
  dequantised: the model holds the quantised values as float `param_dtype`
  weights (32 bits a weight in float32, where a Q4 file stores about 5).
  A value head is freshly initialised from `seed`."""
  file = find_gguf(path)
  if file is None:
    raise FileNotFoundError(f"no .gguf file at {path}")
  hf, tensors = read_gguf(file)
  cfg = config_lib.from_hf_config(hf, dtype=dtype, param_dtype=param_dtype,
                                  value_head=value_head, remat=remat)
  return hf_io.from_tensors(cfg, tensors, source=file, seed=seed)


_SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))


def load_gguf_tokenizer(path: str | os.PathLike):
  """The fast tokenizer a GGUF file's metadata describes: vocabulary,
  merges and pre-tokenizer by transformers' GGUF converter (no torch), the
  bos/eos/unk/pad roles, BOS/EOS insertion and the chat template."""
  # pylint: disable=g-import-not-at-top
  import transformers
  from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

  file = find_gguf(path, TOKENIZER_FILES)
  if file is None:
    raise FileNotFoundError(f"no .gguf file at {path}")
  meta = _metadata(gguf.GGUFReader(str(file)))
  spec = {name: meta[f"tokenizer.{key}"]
          for key, name in mapping.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
          if f"tokenizer.{key}" in meta}
  if "tokens" not in spec:
    raise ValueError(f"{file} holds no tokenizer (no tokenizer.ggml.tokens)")
  backend, _ = mapping.convert_gguf_tokenizer(meta["general.architecture"], spec)
  roles = {role: spec["tokens"][meta[f"tokenizer.ggml.{key}"]]
           for role, key in _SPECIAL_IDS if f"tokenizer.ggml.{key}" in meta}
  # llama.cpp adds BOS to a sentencepiece ("llama") vocabulary unless told not to.
  add_bos = bool(meta.get("tokenizer.ggml.add_bos_token",
                          spec.get("tokenizer_type") == "llama"))
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, chat_template=meta.get("tokenizer.chat_template"),
      add_bos_token=add_bos, add_eos_token=add_eos, **roles)
