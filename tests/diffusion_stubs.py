"""Test helper for the masked-diffusion tests: the tiny config, stub decoders whose
logits are known in advance, a batch of random targets, and the tiny model."""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder

V, MASK = 64, 3
TINY = ModelConfig(vocab_size=V, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                   num_layers=2, sparse_interval=2,
                   moe=MoeConfig(num_experts=4, group_size=4096, min_capacity=64))


class Calls:
  """A list holder (flax turns list attributes into tuples)."""

  def __init__(self):
    self.items = []


class FixedLogits(nn.Module):
  """Stub decoder: logits = bias + 20 * one_hot(answer) (or uniform without answer);
  records the tokens, segment ids, attention kind and train flag of each call."""

  vocab: int = V
  answer_bt: Any = None
  calls: Any = None

  @nn.compact
  def __call__(self, tokens_bt, *, positions_bt=None, segment_ids_bt=None,
               prefix_bt=None, attention_kind="causal", train=False):
    if self.calls is not None:
      self.calls.items.append((tokens_bt, segment_ids_bt, attention_kind, train))
    bias_v = self.param("bias", nn.initializers.zeros, (self.vocab,))
    logits_btv = jnp.broadcast_to(bias_v, tokens_bt.shape + (self.vocab,))
    if self.answer_bt is not None:
      logits_btv = logits_btv + 20.0 * jax.nn.one_hot(self.answer_bt, self.vocab)
    zero = jnp.zeros((), jnp.float32)
    return logits_btv, {"aux_loss": zero, "lb_loss": zero, "z_loss": zero}


def batch_of(b=4, t=16, seed=1, weights=None):
  targets_bt = np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (b, t), 7, V))
  weights_bt = np.ones((b, t), np.float32) if weights is None else weights
  return {"decoder_target_tokens": jnp.asarray(targets_bt, jnp.int32),
          "decoder_input_tokens": jnp.full((b, t), 5, jnp.int32),
          "decoder_loss_weights": jnp.asarray(weights_bt),
          "decoder_segment_ids": jnp.ones((b, t), jnp.int32),
          "decoder_positions": jnp.broadcast_to(jnp.arange(t), (b, t))}


def stub_params(model):  # every stub has the same single bias parameter
  del model
  return FixedLogits().init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]


def tiny_model():
  """Returns (Decoder(TINY), its initialised parameters)."""
  model = Decoder(TINY)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0),
                                        jnp.zeros((1, 16), jnp.int32)))["params"]
  return model, params
