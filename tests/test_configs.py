"""Every experiment config resolves and builds its model, sampler, engine and tasks."""

import pathlib
import sys

from flax import nnx
import pytest

from agentrl_jax import models
from agentrl_jax import tokenizer as T

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from configs import (calculator, default, frozen_lake_turn_credit,  # pylint: disable=wrong-import-position
                     python_tool, qwen_tpu, search_qa)
import train_agent  # pylint: disable=wrong-import-position

CONFIGS = {
    "default": default.get_config, "calculator": calculator.get_config,
    "search_qa": search_qa.get_config, "python_tool": python_tool.get_config,
    **{f"frozen_lake_turn_credit:{s}": (lambda s=s: frozen_lake_turn_credit.get_config(s))
       for s in ("turn_returns", "turn_grpo", "gae", "branching")},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_builds(name):
  cfg = CONFIGS[name]()
  cfg.env.num_train_tasks, cfg.env.num_eval_tasks = 8, 4
  model, sampler, engine, train_tasks, eval_tasks = train_agent.build(cfg)
  assert len(train_tasks) == 8 and len(eval_tasks) == 4
  assert not {t.task_id for t in train_tasks} & {t.task_id for t in eval_tasks}
  assert model.cfg.value_head == (cfg.rl.credit == "gae")
  assert sampler.cache_length == cfg.sampler.cache_length
  s = cfg.sampler.cache_length
  assert sampler.attention_windows == (tuple(cfg.sampler.attention_windows)
                                       or (s // 4, s // 2, s))
  engine.close()


def test_qwen_config_loads_a_local_checkpoint_and_its_tokenizer(tmp_path):
  """A tiny random Qwen2 checkpoint stands in for Qwen2.5-0.5B-Instruct."""
  models.save_pretrained(models.Decoder(models.tiny_config("qwen2"), rngs=nnx.Rngs(0)),
                         tmp_path)
  T.load_tokenizer().save_pretrained(tmp_path)
  cfg = qwen_tpu.get_config(str(tmp_path))
  cfg.env.num_train_tasks, cfg.env.num_eval_tasks = 8, 4
  model, _, engine, _, _ = train_agent.build(cfg)
  assert model.cfg.arch == "qwen2" and str(model.cfg.dtype) == "bfloat16"
  text = "<search>Vorland capital</search>"
  assert len(engine.tok) == 512 and T.encode(engine.tok, text) == T.encode(T.load_tokenizer(), text)
  engine.close()
