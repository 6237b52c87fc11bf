"""Decoder: embed -> scanned blocks -> RMSNorm -> untied head.

Layers are grouped into segments of a repeating unit (e.g. 3 dense blocks + 1 MoE
block for OpenMoE's every-4th layout) and each segment is an `nn.scan` over its
unit, so compile time does not grow with depth.
"""
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from openmoe_jax.config import ModelConfig
from openmoe_jax.layers.attention import Attention, AttentionMask
from openmoe_jax.layers.embeddings import Embed
from openmoe_jax.layers.matmul import rows_matmul
from openmoe_jax.layers.mlp import Mlp
from openmoe_jax.layers.norms import RMSNorm
from openmoe_jax.moe.layer import MoeLayer

Segment = Tuple[Tuple[bool, ...], int]  # (unit pattern: is_sparse per layer, repeats)

_REMAT_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def layer_segments(sparse_layers: Sequence[bool], unit_length: int) -> List[Segment]:
  """Returns the layer list as runs of a repeated unit of `unit_length` layers."""
  segments: List[Segment] = []
  for start in range(0, len(sparse_layers), unit_length):
    unit = tuple(sparse_layers[start:start + unit_length])
    if segments and segments[-1][0] == unit:
      segments[-1] = (unit, segments[-1][1] + 1)
    else:
      segments.append((unit, 1))
  return segments


def scan_unit_length(cfg: ModelConfig) -> int:
  """Returns the unit length the layers are scanned in.

  `sparse_interval` (or 1) for the every-k layouts; for an explicit `layer_pattern`
  the unit length whose segments hold the fewest distinct layers to compile (ties:
  the shorter unit), e.g. 1 for "DDMMMM" and 2 for "DMDMDM".
  """
  if cfg.layer_pattern is None:
    return cfg.sparse_interval or 1
  layers = cfg.sparse_layers()
  cost = lambda n: sum(len(unit) for unit, _ in layer_segments(layers, n))
  return min(range(1, len(layers) + 1), key=lambda n: (cost(n), n))


class LayerSlot(NamedTuple):
  """Where one layer's block lives in the parameter (and intermediates) tree.

  `tree[segment][block]`, indexed by `repeat` along the leading scan axis when the
  segment is scanned (`repeat` None: an unscanned copy named `layers_<i>_<r>`).
  """

  segment: str
  block: str
  repeat: Optional[int]
  sparse: bool


def layer_slots(cfg: ModelConfig) -> List[LayerSlot]:
  """Returns, per model layer in depth order, the LayerSlot holding its block.

  The one definition of the decoder's parameter layout: `Decoder` builds its
  segments from the same `layer_segments(..., scan_unit_length(cfg))`; upcycling,
  the routing recorder and checkpoint conversion read layers through this.
  """
  slots = []
  for i, (unit, repeats) in enumerate(
      layer_segments(cfg.sparse_layers(), scan_unit_length(cfg))):
    for r in range(repeats):
      for j, sparse in enumerate(unit):
        if cfg.scan_layers:
          slots.append(LayerSlot(f"layers_{i}", f"block_{j}", r, sparse))
        else:
          slots.append(LayerSlot(f"layers_{i}_{r}", f"block_{j}", None, sparse))
  return slots


def get_layer(tree: Dict, slot: LayerSlot) -> Dict:
  """Returns one layer's block subtree of `tree` as numpy (scan axis indexed away)."""
  sub = tree[slot.segment][slot.block]
  if slot.repeat is None:
    return jax.tree.map(np.asarray, sub)
  return jax.tree.map(lambda a: np.asarray(a)[slot.repeat], sub)


def set_layer(tree: Dict, slot: LayerSlot, block_tree: Dict) -> None:
  """Writes one layer's block subtree into `tree` (numpy leaves, in place)."""

  def write(dst, new):
    for key, value in new.items():
      if isinstance(value, dict):
        write(dst[key], value)
      elif slot.repeat is None:
        dst[key] = np.asarray(value, dst[key].dtype)
      else:
        dst[key][slot.repeat] = value
  write(tree[slot.segment][slot.block], block_tree)


class Block(nn.Module):
  """Pre-norm transformer block; sparse blocks are ST-MoE residual-MoE blocks."""

  config: ModelConfig
  sparse: bool
  train: bool

  @nn.compact
  def __call__(self, x_btd, positions_bt, mask):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    norm = lambda name: RMSNorm(cfg.norm_eps, dtype, name=name)
    h_btd = norm("pre_attention_norm")(x_btd)
    x_btd = x_btd + Attention(cfg.num_heads, cfg.head_dim, cfg.rope_base, dtype,
                              cfg.qk_norm, cfg.norm_eps, cfg.scale_attention_logits,
                              cfg.attention_impl, name="attention")(
                                  h_btd, positions_bt, mask)
    aux = None
    if self.sparse:
      moe = MoeLayer(cfg.moe, cfg.mlp_kind, cfg.expert_d_ff, dtype, name="moe")
      y_btd, aux = moe(norm("pre_moe_norm")(x_btd), train=self.train)
      x_btd = x_btd + y_btd
    if not self.sparse or cfg.moe.residual_mlp:
      mlp = Mlp(cfg.mlp_kind, cfg.d_ff, dtype, name="mlp")
      x_btd = x_btd + mlp(norm("pre_mlp_norm")(x_btd))
    x_btd = nn.with_logical_constraint(x_btd, ("batch", "length", "act_embed"))
    return x_btd, aux


class Unit(nn.Module):
  """A run of blocks following `pattern`; returns (x, MoE aux stacked per block)."""

  config: ModelConfig
  pattern: Tuple[bool, ...]
  train: bool

  @nn.compact
  def __call__(self, x_btd, positions_bt, mask):
    auxes = []
    for i, sparse in enumerate(self.pattern):
      x_btd, aux = Block(self.config, sparse, self.train, name=f"block_{i}")(
          x_btd, positions_bt, mask)
      if aux is not None:
        auxes.append(aux)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes else {}
    return x_btd, stacked


class Decoder(nn.Module):
  """Decoder-only LM: tokens [b, t] -> (float32 logits [b, t, V], aux).

  aux: `aux_loss` (weighted router losses averaged over MoE layers, 0 if none),
  `lb_loss`, `z_loss`, `tokenwise_lb_loss` (means over MoE layers) and per-MoE-layer
  arrays of the MoE layer's statistics (e.g. `drop_fraction` [L_moe],
  `expert_load` [L_moe, E]). Training with router jitter needs a "jitter" rng.
  """

  config: ModelConfig

  def _unit_cls(self, scanned: bool):
    cfg = self.config
    if cfg.remat_policy == "none":
      return Unit
    return nn.remat(Unit, policy=_REMAT_POLICIES[cfg.remat_policy],
                    prevent_cse=not scanned)

  def _segment(self, index, unit, repeats, train, x_btd, positions_bt, mask):
    cfg = self.config
    name = f"layers_{index}"
    if cfg.scan_layers:
      scanned = nn.scan(
          self._unit_cls(True),
          variable_axes={"params": 0, "intermediates": 0, "cache": 0},
          split_rngs={"params": True, "jitter": True},
          in_axes=(nn.broadcast, nn.broadcast),
          length=repeats, metadata_params={nn.PARTITION_NAME: "layers"})
      return scanned(cfg, unit, train, name=name)(x_btd, positions_bt, mask)
    auxes = []
    for r in range(repeats):
      x_btd, aux = self._unit_cls(False)(cfg, unit, train, name=f"{name}_{r}")(
          x_btd, positions_bt, mask)
      auxes.append(aux)
    return x_btd, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

  @nn.compact
  def __call__(self, tokens_bt: jax.Array, *, positions_bt: Optional[jax.Array] = None,
               segment_ids_bt: Optional[jax.Array] = None,
               prefix_bt: Optional[jax.Array] = None, attention_kind: str = "causal",
               train: bool = False) -> Tuple[jax.Array, Dict[str, Any]]:
    cfg = self.config
    if cfg.vocab_size is None:
      raise ValueError("ModelConfig.vocab_size is unset; train() fills it from the "
                       "task vocabulary, or bind ModelConfig.vocab_size in gin")
    dtype = jnp.dtype(cfg.dtype)
    b, t = tokens_bt.shape
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = AttentionMask.build(attention_kind, segment_ids_bt, prefix_bt)
    x_btd = Embed(cfg.vocab_size, cfg.d_model, cfg.emb_init_std, dtype,
                  name="embed")(tokens_bt)
    unit_length = scan_unit_length(cfg)
    moe_aux = []
    for i, (unit, repeats) in enumerate(layer_segments(cfg.sparse_layers(), unit_length)):
      x_btd, aux = self._segment(i, unit, repeats, train, x_btd, positions_bt, mask)
      if aux:
        moe_aux.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), aux))
    x_btd = RMSNorm(cfg.norm_eps, dtype, name="final_norm")(x_btd)
    head_vd = self.param(
        "head", nn.with_logical_partitioning(
            nn.initializers.normal(cfg.d_model ** -0.5), ("embed", "vocab")),
        (cfg.d_model, cfg.vocab_size), jnp.float32)
    logits_btv = rows_matmul(x_btd, head_vd.astype(dtype),
                             preferred_element_type=jnp.float32)
    return logits_btv, _summarise_moe_aux(moe_aux, cfg)


def _summarise_moe_aux(moe_aux, cfg: ModelConfig) -> Dict[str, Any]:
  """Concatenates per-segment MoE aux in layer order and weights the router losses."""
  if not moe_aux:
    zero = jnp.zeros((), jnp.float32)
    return {"aux_loss": zero, "lb_loss": zero, "z_loss": zero,
            "tokenwise_lb_loss": zero}
  per_layer = jax.tree.map(lambda *a: jnp.concatenate(a), *moe_aux)
  losses = {name: jnp.mean(per_layer.pop(name))
            for name in ("lb_loss", "z_loss", "tokenwise_lb_loss")}
  aux_loss = (cfg.moe.lb_loss_weight * losses["lb_loss"]
              + cfg.moe.z_loss_weight * losses["z_loss"])
  if cfg.moe.tokenwise_lb_loss_weight:
    aux_loss = aux_loss + cfg.moe.tokenwise_lb_loss_weight * losses["tokenwise_lb_loss"]
  return {"aux_loss": aux_loss, **losses, **per_layer}
