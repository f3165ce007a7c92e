"""Train state, the jitted RL/SFT steps, and the RL loop."""

from agentrl_jax.train.state import (OptimConfig, TrainState, checkpointed, init_train_state,
                                     make_optimizer, model_params, reference_params)
from agentrl_jax.train.step import LossConfig, RLStep, SFTStep, decision_mask
