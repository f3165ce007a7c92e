"""Jitted KV-cache sampling: prefill / decode / extend over episode slots."""

from agentrl_jax.sampling.processing import SamplingParams, sample
from agentrl_jax.sampling.sampler import (
    STOP_BUDGET, STOP_CACHE_FULL, STOP_NONE, STOP_SEQUENCE, Action, Sampler,
    SamplerState, SlotSnapshot)
from agentrl_jax.sampling.stops import StopMatcher, StopTables, token_bytes
