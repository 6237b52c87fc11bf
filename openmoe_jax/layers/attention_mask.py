"""Who may attend to whom: the mask kinds, as a description and as a dense mask.

Mask kinds: "causal" (decoder LM), "prefix" (bidirectional inside an inputs prefix,
causal elsewhere: prefix LM / UL2) and "bidirectional" (masked diffusion). Every kind
respects packing: tokens of different segments never attend to each other.

The decoder passes an `AttentionMask` (the kind, segment ids, prefix flags) down to
the attention layers rather than a dense [b, 1, t, t] matrix, so the fused attention
implementations (layers/attention_impls.py) never build one; the plain path builds
it with `AttentionMask.dense` inside the layer.
"""
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from openmoe_jax.config import ATTENTION_KINDS


def make_attention_mask(kind: str, length: int,
                        segment_ids_bt: Optional[jax.Array] = None,
                        prefix_bt: Optional[jax.Array] = None,
                        batch: int = 1) -> jax.Array:
  """Returns a bool mask [b, 1, t_q, t_k]: True where query may attend to key."""
  check_kind(kind, prefix_bt)
  idx = jnp.arange(length)
  causal_tt = idx[:, None] >= idx[None, :]
  if kind == "causal":
    mask_btt = jnp.broadcast_to(causal_tt, (batch, length, length))
  elif kind == "bidirectional":
    mask_btt = jnp.ones((batch, length, length), bool)
  else:
    prefix_bt = prefix_bt.astype(bool)
    both_prefix_btt = prefix_bt[:, :, None] & prefix_bt[:, None, :]
    mask_btt = causal_tt[None] | both_prefix_btt
  if segment_ids_bt is not None:
    mask_btt = mask_btt & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
  return mask_btt[:, None]


def check_kind(kind: str, prefix_bt: Optional[jax.Array]) -> None:
  """Raises ValueError for an unknown mask kind, or "prefix" without prefix flags."""
  if kind not in ATTENTION_KINDS:
    raise ValueError(f"unknown attention kind {kind!r}; choose one of {ATTENTION_KINDS}")
  if kind == "prefix" and prefix_bt is None:
    raise ValueError("attention kind 'prefix' needs prefix flags "
                     "(decoder_causal_attention)")


@flax.struct.dataclass
class AttentionMask:
  """A self-attention mask as its parts: `kind` (static), optional packing
  `segment_ids_bt` and prefix flags `prefix_bt` (kind "prefix"), or an explicit
  bool `explicit_b1tt` mask (then `kind` is ignored; only the plain and XLA
  implementations take one)."""

  kind: str = flax.struct.field(pytree_node=False, default="causal")
  segment_ids_bt: Optional[jax.Array] = None
  prefix_bt: Optional[jax.Array] = None
  explicit_b1tt: Optional[jax.Array] = None

  @classmethod
  def build(cls, kind: str, segment_ids_bt: Optional[jax.Array] = None,
            prefix_bt: Optional[jax.Array] = None) -> "AttentionMask":
    """Returns the mask of `kind`; raises ValueError as `make_attention_mask` does."""
    check_kind(kind, prefix_bt)
    return cls(kind, segment_ids_bt, prefix_bt if kind == "prefix" else None)

  @classmethod
  def explicit(cls, mask_b1tt: jax.Array) -> "AttentionMask":
    """Returns the mask given as a bool array [b, 1, t_q, t_k] (or broadcastable)."""
    return cls("causal", explicit_b1tt=mask_b1tt)

  def dense(self, batch: int, length: int) -> jax.Array:
    """Returns the bool mask [b, 1, t, t] (the explicit one as given)."""
    if self.explicit_b1tt is not None:
      return self.explicit_b1tt
    return make_attention_mask(self.kind, length, self.segment_ids_bt, self.prefix_bt,
                               batch)

  def same_segment_b1tt(self) -> Optional[jax.Array]:
    """Returns the packing term [b, 1, t, t] (True within a segment), None unpacked."""
    if self.segment_ids_bt is None:
      return None
    seg_bt = self.segment_ids_bt
    return (seg_bt[:, :, None] == seg_bt[:, None, :])[:, None]
