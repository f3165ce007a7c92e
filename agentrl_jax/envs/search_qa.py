"""SearchQA: a ReAct search-and-answer environment over a fictional corpus.

The corpus (people, the cities they were born in, their companies and books,
the countries of the cities) is generated from made-up syllables with a fixed
seed, so no pretrained model knows an answer: the agent has to search.
Questions are 1-hop ("Where was X born?", level 0) or 2-hop ("In which
country is the city where X was born?", level 1: search the person, read the
city, search the city). Retrieval is BM25 (`rank_bm25`) over one short
passage per person and per city.

Rewards: outcome 1.0 for an exact match after normalisation (not containment,
which rewards listing candidates); process `process_bonus` the first time a
search retrieves each passage the answer needs.

`search_tool_env()` ("search_qa_tools" in the registry) is the same task
with `search` as a JSON tool (`envs.ToolEnv`), for the `qwen2.5` chat
format: the calling convention Qwen2.5-Instruct already knows. Its answer
is a turn without a call; it has no process bonus.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import string
from types import MappingProxyType
from typing import Any, Iterator, Mapping, NamedTuple

import numpy as np
from rank_bm25 import BM25Okapi

from agentrl_jax.envs.base import Expert, Task, TextEnvironment, canonical_text, tool_call

SPLITS = ("train", "test")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "th", "br", "dr", "kr", "st")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s")
_COMPANY_SUFFIXES = ("Works", "Labs", "Trading", "Foundry", "Systems", "Mills")
_BOOK_ADJECTIVES = ("Silent", "Broken", "Golden", "Hidden", "Last", "Crimson",
                    "Distant", "Hollow", "Quiet", "Wandering", "Frozen", "Iron",
                    "Pale", "Burning", "Secret", "Lonely", "Bright", "Sunken",
                    "Endless", "Forgotten")
_BOOK_NOUNS = ("Harbor", "Lantern", "Orchard", "Tower", "River", "Garden",
               "Winter", "Mirror", "Road", "Crown", "Forest", "Bridge", "Island",
               "Letter", "Storm", "Mountain", "Feather", "Clock", "Meadow",
               "Voyage", "Shadow", "Bell", "Window", "Sea", "Field")
_N_PEOPLE, _N_FIRST_NAMES, _N_CITIES, _N_COUNTRIES = 400, 120, 80, 20

# relation -> the phrase linking subject and value in a passage.
_PHRASES = {"born": "was born in", "founded": "founded", "wrote": "wrote the book"}
_QUESTIONS = {
    "born": "Where was {} born?",
    "founded": "Which company did {} found?",
    "wrote": "Which book did {} write?",
    "born_country": "In which country is the city where {} was born?",
}
_USAGE = ("<search>query</search>", "<answer>answer</answer>")


class _Person(NamedTuple):
  name: str
  facts: Mapping[str, str]  # relation -> value, e.g. {"born": "Kelmora"}
  passage: int


class _Corpus(NamedTuple):
  passages: tuple[str, ...]
  people: tuple[_Person, ...]
  cities: Mapping[str, tuple[str, int]]  # city -> (country, passage id)
  bm25: BM25Okapi  # read-only after construction


def _tokenize(text: str) -> list[str]:
  return re.findall(r"\w+", text.lower())


def _words(rng: random.Random, n: int, used: set[str]) -> list[str]:
  """`n` new capitalised made-up words, unique across everything in `used`
  (so a name token never collides with a city or company)."""
  out = []
  while len(out) < n:
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(rng.choice((2, 2, 3)))).capitalize()
    if word not in used:
      used.add(word)
      out.append(word)
  return out


@functools.cache
def _corpus() -> _Corpus:
  """The fixed corpus, built once per process; never mutated."""
  rng, used = random.Random(20240611), set()
  countries = _words(rng, _N_COUNTRIES, used)
  city_names = _words(rng, _N_CITIES, used)
  firsts = _words(rng, _N_FIRST_NAMES, used)
  lasts = _words(rng, _N_PEOPLE, used)
  companies = [f"{w} {rng.choice(_COMPANY_SUFFIXES)}"
               for w in _words(rng, _N_PEOPLE, used)]
  books = [f"The {a} {n}" for a in _BOOK_ADJECTIVES for n in _BOOK_NOUNS]
  books = rng.sample(books, _N_PEOPLE)
  passages, people, cities = [], [], {}
  for city in city_names:
    country = rng.choice(countries)
    cities[city] = (country, len(passages))
    passages.append(f"{city} is a city in {country}.")
  for last, company, book in zip(lasts, companies, books):
    name = f"{rng.choice(firsts)} {last}"
    facts = {"born": rng.choice(city_names), "founded": company, "wrote": book}
    people.append(_Person(name, MappingProxyType(facts), len(passages)))
    passages.append(" ".join(f"{name} {_PHRASES[r]} {v}." for r, v in facts.items()))
  return _Corpus(tuple(passages), tuple(people), MappingProxyType(cities),
                 BM25Okapi([_tokenize(p) for p in passages]))


def _split_of(name: str) -> str:
  """A stable hash partition of people: about 1 in 5 is a test person."""
  return "test" if hashlib.sha256(name.encode()).digest()[0] % 5 == 0 else "train"


def normalize_answer(text: str) -> str:
  """Lowercase, punctuation to spaces, drop articles, collapse whitespace."""
  text = text.lower().translate(str.maketrans(string.punctuation, " " * len(string.punctuation)))
  return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact_match(prediction: str, gold: str) -> bool:
  return normalize_answer(prediction) == normalize_answer(gold)


def _fact(observation: str, subject: str, phrase: str) -> str:
  """Reads "<subject> <phrase> <value>." out of retrieved passages."""
  match = re.search(rf"\b{re.escape(subject)} {phrase} (.+?)\.", observation)
  if match is None:
    raise RuntimeError(f"expert: no '{subject} {phrase}' in {observation!r}")
  return match.group(1)


class _GeneratorExpert:
  """Adapts a generator that receives observations into an `Expert`."""

  def __init__(self, gen: Iterator[str]):
    self._gen, self._started = gen, False

  def __call__(self, observation: str) -> str:
    if not self._started:
      self._started = True
      return next(self._gen)
    return self._gen.send(observation)


class SearchQAEnv(TextEnvironment):
  """Answer questions about fictional entities with a BM25 search tool.

  Args:
    top_k: passages returned per search.
    process_bonus: "process" reward the first time each gold passage is
      retrieved (so at most 1x for 1-hop, 2x for 2-hop questions).
    max_query_words: longer queries are cut (BM25 costs O(words x corpus)).
  """

  system_prompt = (
      "Answer the question by searching an encyclopedia of fictional people "
      "and places. To search, write <search>query</search>; the top passages "
      "come back numbered. When you know the answer, write "
      "<answer>answer</answer> with only the answer. You may reason first "
      "inside <think>...</think>.")
  stop_strings = ("</search>", "</answer>")

  def __init__(self, *, top_k: int = 3, process_bonus: float = 0.1,
               max_query_words: int = 32, format_penalty: float = 0.0,
               step_cost: float = 0.0):
    super().__init__(format_penalty=format_penalty, step_cost=step_cost)
    self.top_k, self.process_bonus = top_k, process_bonus
    self.max_query_words = max_query_words
    self._credited: set[int] = set()

  @classmethod
  def tasks(cls, split: str, n: int, seed: int, *, hops: tuple[int, ...] = (1, 2)) -> list[Task]:
    """`n` distinct questions about people of `split`, sampled with `seed`."""
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    corpus, pool = _corpus(), []
    for person in corpus.people:
      if _split_of(person.name) != split:
        continue
      for relation, question in _QUESTIONS.items():
        level = int(relation == "born_country")
        if level + 1 not in hops:
          continue
        if level:
          city = person.facts["born"]
          answer, gold = corpus.cities[city][0], (person.passage, corpus.cities[city][1])
        else:
          answer, gold = person.facts[relation], (person.passage,)
        pool.append(Task(
            f"searchqa/{relation}/{person.name.replace(' ', '_')}",
            question.format(person.name),
            {"answer": answer, "gold_passages": gold, "person": person.name,
             "relation": relation},
            level))
    if n > len(pool):
      raise ValueError(f"asked for {n} tasks, split {split!r} with hops={hops} has {len(pool)}")
    return random.Random(seed).sample(pool, n)

  @classmethod
  def expert(cls, task: Task) -> Expert:
    """Searches the person (then, for 2-hop, the city read from the results)
    and answers with the value read from the retrieved passages."""
    person, relation = task.data["person"], task.data["relation"]

    def policy():
      observation = yield f"<search>{person}</search>"
      if relation == "born_country":
        city = _fact(observation, person, _PHRASES["born"])
        observation = yield f"<search>{city}</search>"
        answer = _fact(observation, city, "is a city in")
      else:
        answer = _fact(observation, person, _PHRASES[relation])
      yield f"<answer>{answer}</answer>"

    return _GeneratorExpert(policy())

  def _reset(self, task: Task) -> str:
    self._credited = set()
    return f"Question: {task.prompt}"

  def state_key(self, observation: str) -> tuple[str, tuple[int, ...]]:
    """The observation, and the gold passages already credited (they pay
    no process bonus again, so they are part of the state)."""
    return canonical_text(observation), tuple(sorted(self._credited))

  def _step(self, action: str) -> tuple[str, dict[str, float], bool, dict[str, Any]]:
    call = tool_call(action)
    rejected = self.reject(call, ("search", "answer"), _USAGE)
    if rejected:
      return rejected
    tool, argument = call[0], call[1].strip()
    if tool == "answer":
      correct = exact_match(argument, self.task.data["answer"])
      return ("Correct." if correct else "Incorrect.", {"outcome": float(correct)},
              True, {"correct": correct})
    return self._search(argument)

  def _search(self, query: str) -> tuple[str, dict[str, float], bool, dict[str, Any]]:
    words = _tokenize(query)[:self.max_query_words]
    if not words:
      return ("Error: empty search query.", {"format": -self.format_penalty}, False,
              {"tool_call": True, "tool_error": True})
    ids = _retrieve(words, self.top_k)
    if not ids:
      return "No results.", {}, False, {"tool_call": True, "retrieved": []}
    hits = (set(ids) & set(self.task.data["gold_passages"])) - self._credited
    self._credited |= hits
    return (_numbered(ids), {"process": self.process_bonus * len(hits)}, False,
            {"tool_call": True, "retrieved": ids, "gold_hits": len(hits)})


def _retrieve(words: list[str], top_k: int) -> list[int]:
  """The ids of the `top_k` passages BM25 scores above 0, best first."""
  scores = _corpus().bm25.get_scores(words)
  return [int(i) for i in np.argsort(-scores, kind="stable")[:top_k] if scores[i] > 0]


def _numbered(ids: list[int]) -> str:
  return "\n".join(f"[{rank}] {_corpus().passages[i]}" for rank, i in enumerate(ids, 1))


def search(query: str) -> str:
  """Searches an encyclopedia of fictional people and places.

  Args:
    query: Words to look for, e.g. a person's or a city's name.
  """
  words = _tokenize(query)[:32]
  if not words:
    raise ValueError("empty search query")
  return _numbered(_retrieve(words, 3)) or "No results."


def _json_expert(task: Task) -> Expert:
  """SearchQAEnv's expert, calling `search` with JSON and answering plainly."""
  from agentrl_jax import tools  # pylint: disable=import-outside-toplevel
  person, relation = task.data["person"], task.data["relation"]

  def policy():
    (observation,) = yield tools.render_call("search", {"query": person})
    if relation == "born_country":
      city = _fact(observation, person, _PHRASES["born"])
      (observation,) = yield tools.render_call("search", {"query": city})
      yield _fact(observation, city, "is a city in")
    else:
      yield _fact(observation, person, _PHRASES[relation])

  return _GeneratorExpert(policy())


def search_tool_env(**kwargs):
  """SearchQA with `search` as a JSON tool (a `ToolEnv`); kwargs go to it."""
  from agentrl_jax.envs.tool_env import ToolEnv  # pylint: disable=import-outside-toplevel
  return ToolEnv(
      tools=[search], reward_fn=lambda task, answer: float(exact_match(answer, task.data["answer"])),
      tasks=SearchQAEnv.tasks, expert=_json_expert,
      system_prompt=("Answer the question by searching an encyclopedia of fictional people "
                     "and places. When you know the answer, reply with only the answer."),
      **kwargs)
