"""Llama/Qwen2/Qwen3/Gemma 2/Gemma 3 decoders in Flax NNX; local Hugging Face checkpoints and GGUF files."""

from agentrl_jax.models.config import (
    ModelConfig, SUPPORTED_ARCHS, from_hf_config, tiny_config, to_hf_config)
from agentrl_jax.models.decoder import Decoder, KVCache, compute_params
from agentrl_jax.models.hf_io import from_pretrained, save_pretrained
from agentrl_jax.models import gguf_io
from agentrl_jax.models.gguf_io import from_gguf
from agentrl_jax.models import lora
from agentrl_jax.models.lora import LoraConfig, add_adapters
