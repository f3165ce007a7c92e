"""Your own task, as a user writes one: two Python functions are the tools.

The model answers questions about a company's warehouses that it cannot
know: how many units of an item one holds (`stock`) and how many it can
hold (`capacity`). It calls the right tool with JSON (two calls in one turn
when the question is about two warehouses), reads the results and answers
with them. The tables are made up (seeded), so only the tools know.
Tasks are in warehouse_tasks.jsonl next to this file. The tiny model's
vocabulary is in warehouse_tokenizer.json: a 1024-token BPE of these
conversations whose merges span words (the fixed system turn with the
schemas is a few tokens), with Qwen's atomic `<tool_call>` tags and, as in
Qwen's vocabulary, one token per digit. `python
experiments/configs/warehouse_tools.py` writes both files again.
"""

import pathlib
import random
from typing import Literal

from agentrl_jax import envs, tools

ITEMS = ("bolts", "nuts", "gears")
WAREHOUSES = tuple(f"W{i}" for i in range(10, 100))
TASKS_FILE = pathlib.Path(__file__).with_name("warehouse_tasks.jsonl")
TOKENIZER_FILE = pathlib.Path(__file__).with_name("warehouse_tokenizer.json")
VOCAB_SIZE = 1024
_rng = random.Random(0)
_STOCK = {(w, item): _rng.randint(100, 999) for w in WAREHOUSES for item in ITEMS}
_CAPACITY = {w: _rng.randint(1000, 9999) for w in WAREHOUSES}


def stock(warehouse: str, item: Literal["bolts", "nuts", "gears"]) -> int:
  """Units of an item held in a warehouse.

  Args:
    warehouse: The warehouse's code.
    item: The item to count.
  """
  return _STOCK[warehouse, item]  # an unknown code raises: the model reads the error


def capacity(warehouse: str) -> int:
  """How many units a warehouse can hold.

  Args:
    warehouse: The warehouse's code.
  """
  return _CAPACITY[warehouse]


def exact_answer(task: envs.Task, answer: str) -> float:
  """1 when the answer is the looked-up number(s), spaces aside."""
  return float(" ".join(answer.split()) == task.data["answer"])


def expert(task: envs.Task):
  """Makes the calls the question needs in one turn, then answers with the results."""
  def act(observation):
    if isinstance(observation, str):  # the question
      return "\n".join(tools.render_call(name, args) for name, args in task.data["calls"])
    return " and ".join(observation)  # the calls' results, in call order
  return act


def make_env(**kwargs) -> envs.ToolEnv:
  return envs.ToolEnv(
      tools=[stock, capacity], reward_fn=exact_answer, tasks=TASKS_FILE, expert=expert,
      system_prompt="Answer with the value the tools give.", **kwargs)


def all_tasks() -> list[dict]:
  """One call (level 0) for every warehouse; two parallel calls (level 1)
  for 270 seeded pairs of warehouses."""
  rows = []
  for w in WAREHOUSES:
    for item in ITEMS:
      rows.append({"id": f"stock/{w}/{item}", "prompt": f"How many {item} are in warehouse {w}?",
                   "answer": str(_STOCK[w, item]),
                   "calls": [["stock", {"warehouse": w, "item": item}]]})
    rows.append({"id": f"capacity/{w}", "prompt": f"How many units can warehouse {w} hold?",
                 "answer": str(_CAPACITY[w]), "calls": [["capacity", {"warehouse": w}]]})
  rng, pairs = random.Random(1), set()
  while len(pairs) < 270:
    a, b = rng.sample(WAREHOUSES, 2)
    item = rng.choice(ITEMS)
    if (a, b, item) in pairs:
      continue
    pairs.add((a, b, item))
    rows.append({"id": f"stock/{a}+{b}/{item}",
                 "prompt": f"How many {item} are in warehouses {a} and {b}?",
                 "answer": f"{_STOCK[a, item]} and {_STOCK[b, item]}", "level": 1,
                 "calls": [["stock", {"warehouse": w, "item": item}] for w in (a, b)]})
  return rows


def build_tokenizer():
  """A BPE of the train split's expert conversations (qwen2.5 format)."""
  from agentrl_jax import tokenizer  # pylint: disable=import-outside-toplevel
  corpus = []
  for task in envs.load_tasks(TASKS_FILE):
    if envs.base.hashed_split(task.prompt)[0] == "train":
      act, env = expert(task), make_env()
      observation, _ = env.reset(task)
      call = act(observation) + "<|im_end|>"
      results = env.step(call).observation
      corpus.append(tokenizer.QWEN25.render(env.system_prompt, task.prompt, [
          call, act(results) + "<|im_end|>"], [results], env.tools))
  return tokenizer.train_bpe_tokenizer(corpus, VOCAB_SIZE, added_tokens=(
      *tokenizer.TOOL_TAGS, "<tool_call>", "</tool_call>"), individual_digits=True,
      merge_across_words=True)


if __name__ == "__main__":
  import json
  TASKS_FILE.write_text("".join(json.dumps(r) + "\n" for r in all_tasks()))
  build_tokenizer().save(str(TOKENIZER_FILE))
  print(f"wrote {len(all_tasks())} tasks to {TASKS_FILE} and {TOKENIZER_FILE}")
