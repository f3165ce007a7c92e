"""benchmarks/state_memory.py: the per-device byte counts, by hand.

One subprocess with 8 simulated CPU devices (the XLA flag must be set
before jax starts) runs the script as `__main__` (the three Qwen2.5 models,
shapes only), then its `state_memory` on tiny models, and prints its own
peak RSS: a 7B's float32 masters alone would be 28 GiB, so a small RSS shows
that nothing was allocated.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30

_CHILD = """
import json, runpy
ns = runpy.run_path("benchmarks/state_memory.py", run_name="__main__")
from agentrl_jax import models
import jax.numpy as jnp
tiny = models.tiny_config("qwen2", dtype=jnp.bfloat16, param_dtype=jnp.float32)
odd = tiny.replace(hidden_size=132)  # 132 rows do not split 8 ways
print(json.dumps({
    "tiny": {n: ns["state_memory"](tiny, n) for n in (1, 2, 4, 8)},
    "odd": {n: ns["state_memory"](odd, n) for n in (1, 8)},
    "odd_replicated": ns["replicated_leaves"](odd, 8),
    "tiny_replicated": ns["replicated_leaves"](tiny, 8),
    # VmHWM, not ru_maxrss: exec keeps the parent's high-water mark in the latter.
    "maxrss_kib": int(next(l.split()[1] for l in open("/proc/self/status")
                           if l.startswith("VmHWM:")))}))
"""

# tiny_config("qwen2"): V=512, d=128, F=256, 2 layers, 4 heads and 2 kv heads
# of 32, untied. Matrices (all split over fsdp along d):
#   embed 512*128 + lm_head 128*512                          = 131072
#   per layer q 128*128 + k, v 2*128*64 + o 128*128 + mlp 3*128*256
#             = 16384 + 16384 + 16384 + 98304 = 147456, x 2 = 294912
# Replicated by rule: q, k, v biases 2*(128+64+64) = 512; norms 2*2*128 + 128
# = 640.
SPLIT = 131072 + 294912
REPLICATED = 512 + 640
TINY_PARAMS = SPLIT + REPLICATED  # 427136


@pytest.fixture(scope="module")
def run():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"))
  proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  *lines, data = proc.stdout.strip().splitlines()
  pairs = dict(kv.split("=") for kv in lines[-1].split())
  return pairs, json.loads(data)


def test_published_parameter_counts_and_20_bytes_each(run):
  pairs, _ = run
  # Hugging Face's counts for Qwen/Qwen2.5-{0.5B,1.5B,7B}.
  for name, count in [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304),
                      ("qwen2.5-7b", 7_615_616_512)]:
    assert int(pairs[f"{name}_params"]) == count
    # 4 masters + 8 moments + 4 gradients + 2 reference + 2 sampler = 20 bytes.
    assert float(pairs[f"{name}_fsdp1_gib"]) == pytest.approx(20 * count / GIB, abs=1e-3)
    # Every matrix divides 8 ways; only biases and norms (< 0.1%) stay whole.
    assert float(pairs[f"{name}_fsdp8_gib"]) == pytest.approx(
        20 * count / GIB / 8, rel=1e-2)


def test_lora_trains_its_adapters_and_keeps_one_bf16_base(run):
  pairs, _ = run
  # Rank r on every linear of a layer: r * (din + dout) summed over q, k, v,
  # o, gate, up, down. 0.5B (d = 896, kv = 2 x 64, F = 4864):
  #   1792 + 1024 + 1024 + 1792 + 3 * 5760 = 22912 a layer, x 24 layers;
  # 7B (d = 3584, kv = 4 x 128, F = 18944): 7168 + 2 * 4096 + 7168 + 3 * 22528
  #   = 90112 a layer, x 28 layers.
  for name, per_rank, count in [("qwen2.5-0.5b", 22912 * 24, 494_032_768),
                                ("qwen2.5-7b", 90112 * 28, 7_615_616_512)]:
    for rank in (8, 16):
      trained = int(pairs[f"{name}_lora{rank}_trainable"])
      assert trained == rank * per_rank
      # 20 bytes a trained parameter as above; the base 4: the state's frozen
      # bf16 copy and the sampler's.
      assert float(pairs[f"{name}_lora{rank}_fsdp1_gib"]) == pytest.approx(
          (20 * trained + 4 * count) / GIB, abs=1e-3)
  assert float(pairs["qwen2.5-7b_lora8_fsdp1_gib"]) < 0.21 * float(
      pairs["qwen2.5-7b_fsdp1_gib"])


def test_tiny_model_by_hand(run):
  _, data = run
  for n, m in data["tiny"].items():
    per_param = SPLIT // int(n) + REPLICATED  # 128 rows divide 1, 2, 4, 8 ways
    assert m["params"] == TINY_PARAMS
    assert m["masters"] == m["gradients"] == 4 * per_param
    assert m["reference"] == m["sampler"] == 2 * per_param
    # mu and nu, plus the int32 step counters of adam and the lr schedule.
    assert 0 <= m["moments"] - 8 * per_param <= 16
    assert m["frozen"] == 0  # full fine-tuning: no frozen base
    assert m["total"] == sum(m[k] for k in ("masters", "moments", "gradients",
                                            "reference", "sampler"))
  assert data["tiny_replicated"] == []


def test_indivisible_dims_stay_replicated(run):
  _, data = run
  # Every matrix splits over fsdp along d, and d=132 does not divide by 8, so
  # each device holds the whole state: the 16 matrices (embed, lm_head,
  # 7 per layer) are reported, and fsdp=8 costs what fsdp=1 does.
  odd = data["odd"]
  assert odd["8"]["total"] == odd["1"]["total"]
  assert len(data["odd_replicated"]) == 16
  assert "layers/0/mlp/down_proj/kernel" in data["odd_replicated"]


def test_nothing_is_allocated(run):
  _, data = run
  # The 7B's masters alone would be 28 GiB; jax and flax import in ~0.3 GiB.
  assert data["maxrss_kib"] < 2 * 2**20
