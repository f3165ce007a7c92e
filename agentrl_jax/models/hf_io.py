"""Local Hugging Face checkpoints in and out: config.json + *.safetensors.

Never touches the network: configs are read with `local_files_only=True`.
Set HF_HUB_OFFLINE=1 in the environment before the process starts, or a
path typo can make transformers retry the hub for ~45 s before failing.

Parameter names map one to one onto transformers' Llama/Qwen2/Qwen3/Gemma 2/
Gemma 3 (text-only Gemma3ForCausalLM) names: our NNX path
`layers.3.self_attn.q_proj.kernel` is `model.layers.3.self_attn.q_proj.weight`
transposed (torch Linear stores [out, in]); `embed_tokens.embedding` is
`model.embed_tokens.weight`; `lm_head.kernel` is `lm_head.weight`. Gemma's
norm weights are stored as transformers stores them (the w of 1 + w). The
optional value head is ours, not HF's: it is saved next to the
export as `value_head.safetensors` and loaded from there when present.
LoRA adapters have no HF name: an adapted model exports merged.
GGUF files load through the same name table (`gguf_io`).
"""

from __future__ import annotations

import json
import os
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from agentrl_jax.models import config as config_lib
from agentrl_jax.models import lora
from agentrl_jax.models.decoder import Decoder

VALUE_HEAD_FILE = "value_head.safetensors"
_MAX_SHARD_BYTES = 4 << 30
# Tensors some exports carry that hold no learned state of ours.
_IGNORED = ("rotary_emb.inv_freq",)


def _hf_name(path: tuple) -> tuple[str, bool]:
  """Our NNX param path -> (HF tensor name, transpose?)."""
  parts = [str(p) for p in path]
  transpose = parts[-1] == "kernel"
  if parts[-1] in ("kernel", "embedding"):
    parts[-1] = "weight"
  name = ".".join(parts)
  if parts[0] in ("lm_head", "value_head"):
    return name, transpose
  return "model." + name, transpose


def _param_table(model: Decoder) -> dict[str, tuple[tuple, bool, bool]]:
  """HF name -> (our path, transpose, is value head) for every parameter."""
  table = {}
  for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, transpose = _hf_name(path)
    table[name] = (path, transpose, path[0] == "value_head")
  return table


def _read_tensors(files: list[pathlib.Path]) -> dict[str, np.ndarray]:
  tensors = {}
  for f in files:
    with safetensors.safe_open(str(f), framework="numpy") as handle:
      for name in handle.keys():
        tensors[name] = handle.get_tensor(name)
  return tensors


def _weight_files(local_dir: pathlib.Path) -> list[pathlib.Path]:
  index = local_dir / "model.safetensors.index.json"
  if index.exists():
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing = [s for s in shards if not (local_dir / s).exists()]
    if missing:
      raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
    return [local_dir / s for s in shards]
  files = sorted(p for p in local_dir.glob("*.safetensors") if p.name != VALUE_HEAD_FILE)
  if not files:
    raise FileNotFoundError(
        f"no *.safetensors weights in {local_dir} (only safetensors checkpoints "
        "are supported; convert .bin/.pth ones with transformers first)")
  return files


def from_pretrained(local_dir: str | os.PathLike, *, dtype=jnp.float32,
                    param_dtype=jnp.float32, value_head: bool = False,
                    remat: bool = False, seed: int = 0) -> Decoder:
  """Loads a local Llama/Qwen2/Qwen3/Gemma 2/Gemma 3 text checkpoint.

  Args:
    local_dir: a directory as written by transformers' `save_pretrained`
      (single file or sharded with `model.safetensors.index.json`); or a
      llama.cpp `.gguf` file, or a directory holding one and no config.json
      (Llama/Qwen2/Qwen3; see `gguf_io.from_gguf`).
    dtype: activation dtype (norms and softmax run in float32 regardless).
    param_dtype: parameter dtype: float32 masters whatever `dtype` (a bf16
      checkpoint converts exactly; a 1e-6 update to bf16 weights mostly
      rounds away).
    value_head: add a value head; loaded from `value_head.safetensors` if the
      directory has one (our export), else freshly initialised from `seed`.
    remat: recompute layer activations in the backward pass.
  Raises:
    FileNotFoundError: no such directory / config / weights.
    ValueError: unsupported architecture, or tensors missing, unexpected or
      of the wrong shape (the message lists them).
  """
  # Imported here: gguf_io loads through this module's `from_tensors`.
  from agentrl_jax.models import gguf_io  # pylint: disable=g-import-not-at-top

  gguf_file = gguf_io.find_gguf(local_dir)
  if gguf_file is not None:
    return gguf_io.from_gguf(gguf_file, dtype=dtype, param_dtype=param_dtype,
                             value_head=value_head, remat=remat, seed=seed)
  local_dir = pathlib.Path(local_dir)
  if not (local_dir / "config.json").exists():
    raise FileNotFoundError(f"{local_dir} has no config.json (is it a local "
                            "Hugging Face checkpoint directory?)")
  import transformers  # pylint: disable=g-import-not-at-top

  hf = transformers.AutoConfig.from_pretrained(str(local_dir), local_files_only=True)
  cfg = config_lib.from_hf_config(
      hf, dtype=dtype, param_dtype=param_dtype, value_head=value_head,
      remat=remat)
  tensors = _read_tensors(_weight_files(local_dir))
  if value_head and (local_dir / VALUE_HEAD_FILE).exists():
    tensors.update(_read_tensors([local_dir / VALUE_HEAD_FILE]))
  return from_tensors(cfg, tensors, source=local_dir, seed=seed)


def from_tensors(cfg: config_lib.ModelConfig, tensors: dict[str, np.ndarray], *,
                 source: str | os.PathLike = "checkpoint", seed: int = 0) -> Decoder:
  """A decoder for `cfg` holding `tensors` (HF names, torch layouts).

  The one place names, transposes and shapes are checked (`from_pretrained`
  and `gguf_io` both load through it). A value head missing from `tensors`
  is freshly initialised from `seed`.
  """
  model = Decoder(cfg, rngs=nnx.Rngs(seed)) if cfg.value_head else nnx.eval_shape(
      lambda: Decoder(cfg, rngs=nnx.Rngs(seed)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  flat = dict(nnx.to_flat_state(params))
  table = _param_table(model)
  expected = {n for n, (_, _, is_vh) in table.items() if not is_vh}
  missing = sorted(expected - tensors.keys())
  ignored = {n for n in tensors if n.endswith(_IGNORED)}
  if cfg.tie_word_embeddings:
    ignored.add("lm_head.weight")  # some tied exports still carry a copy
  unexpected = sorted(tensors.keys() - table.keys() - ignored)
  if missing or unexpected:
    raise ValueError(
        f"checkpoint {source} does not match a {cfg.arch} decoder with this "
        f"config.\n  missing tensors ({len(missing)}): {missing}\n  unexpected "
        f"tensors ({len(unexpected)}): {unexpected}\n  expected names: "
        f"{sorted(expected)}")
  for name, (path, transpose, _) in table.items():
    if name not in tensors:
      continue  # a fresh value head keeps its initialisation
    array = tensors[name].T if transpose else tensors[name]
    want = flat[path].get_value().shape
    if array.shape != want:
      raise ValueError(f"tensor {name} has shape {array.shape}, expected "
                       f"{want[::-1] if transpose else want}")
    flat[path].set_value(jnp.asarray(array, dtype=cfg.param_dtype))
  return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)


def save_pretrained(model: Decoder, out_dir: str | os.PathLike, *,
                    hf_config=None) -> pathlib.Path:
  """Exports an HF-format directory that transformers and vLLM can load.

  Writes config.json and model.safetensors (sharded with an index past
  4 GiB), in the parameter dtype; the value head, if any, goes to
  `value_head.safetensors`. A model with LoRA adapters is written merged
  (`lora.merge`: each kernel W + (alpha / r) A B, in W's dtype), the
  function it computes: transformers has no name for separate adapters
  and would load the bare base without an error. Pass the original
  `hf_config` (e.g. `transformers.AutoConfig.from_pretrained(src)`) to
  keep fields we don't model, such as token ids.
  """
  if lora.has_adapters(model):
    model = lora.merge(model)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  base = hf_config.to_dict() if hf_config is not None else None
  config_lib.to_hf_config(model.cfg, base).save_pretrained(str(out_dir))
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  weights, head = {}, {}
  for name, (path, transpose, is_vh) in _param_table(model).items():
    array = np.asarray(jax.device_get(flat[path].get_value()))
    (head if is_vh else weights)[name] = np.ascontiguousarray(array.T if transpose else array)
  if head:
    safetensors.numpy.save_file(head, str(out_dir / VALUE_HEAD_FILE))
  shards, size = [{}], 0
  for name in sorted(weights):
    if size and size + weights[name].nbytes > _MAX_SHARD_BYTES:
      shards.append({})
      size = 0
    shards[-1][name] = weights[name]
    size += weights[name].nbytes
  if len(shards) == 1:
    safetensors.numpy.save_file(shards[0], str(out_dir / "model.safetensors"),
                                metadata={"format": "pt"})
    return out_dir
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors.numpy.save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in shard})
  total = sum(a.nbytes for a in weights.values())
  (out_dir / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
  return out_dir
