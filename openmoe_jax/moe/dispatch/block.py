"""Block dispatch: kept choices packed expert by expert, one chunked expert-MLP loop
(kernels/block_mlp.py). The CPU engine for capacity and dropless routing alike."""
import dataclasses
from typing import Optional

import gin
import jax
import jax.numpy as jnp

from openmoe_jax.kernels.block_mlp import ChunkSizes, chunked_expert_ffn, expert_rows
from openmoe_jax.moe.dispatch.base import ExpertWeights
from openmoe_jax.moe.dispatch.primitives import max_kept_rows
from openmoe_jax.moe.routers import Routing


def block_rows(routing: Routing, num_experts: int, unkept_row: int):
  """Returns (row_gsk, layout): each kept choice's row when the kept choices sit
  expert by expert (`unkept_row` where not kept) and the experts' rows.

  Expert e's rows are its kept choices of group 0 in slot order, then group 1's,
  ...; experts follow each other in order. The routers give each expert's kept
  choices of a group the slots 0, 1, ..., so a choice's row is its expert's start +
  the kept counts of the groups before it + its slot."""
  g = routing.kept.shape[0]
  kept_gsk = routing.kept
  expert_gsk = routing.expert_index
  group_gsk = jnp.broadcast_to(jnp.arange(g)[:, None, None], kept_gsk.shape)
  count_ge = jnp.zeros((g, num_experts), jnp.int32).at[group_gsk, expert_gsk].add(
      kept_gsk.astype(jnp.int32))
  layout = expert_rows(jnp.sum(count_ge, axis=0))
  start_ge = layout.start_e + jnp.cumsum(count_ge, axis=0) - count_ge
  row_gsk = start_ge[group_gsk, expert_gsk] + routing.slot
  return jnp.where(kept_gsk, row_gsk, unkept_row).astype(jnp.int32), layout


# Bounds of the automatic chunk size (`chunk_rows`).
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 128, 512


def chunk_rows(mean_rows_per_expert: float) -> int:
  """Returns the automatic `big` chunk: the largest power of two at most half the
  mean rows per expert, within [MIN_CHUNK_ROWS, MAX_CHUNK_ROWS].

  Why (benchmarks/moe_layer.py, fwd+bwd on a 2-core CPU, chunk sizes timed in
  pairs with the dense MLP in one process): at (d 768, f 2048, E 16, k 2, 4096
  tokens), 512 rows per expert, the block path took 1.39x the dense time with
  chunks of 128 rows and 1.17x / 1.16x with 256 / 512: every chunk reads and writes
  the expert's float32 [d, f] gradient accumulators (6 MiB each there), so fewer,
  longer chunks move less memory. Half the mean keeps an expert near the mean in
  two or three chunks with little run-past padding. At 128 rows per expert (E 64
  and E 256 at 4096 tokens) 128 beat 64 and 256 (1.52x vs 1.62x / 1.97x, E 64)."""
  size = MIN_CHUNK_ROWS
  while size * 2 <= min(mean_rows_per_expert / 2, MAX_CHUNK_ROWS):
    size *= 2
  return size


@gin.configurable
@dataclasses.dataclass(frozen=True)
class BlockDispatcher:
  """Packs each expert's kept choices into contiguous rows (no capacity buffers, no
  padding between experts), runs each expert's whole gated MLP over its rows in
  chunks of `big` rows (the rest in chunks of big / 2, ..., `small` rows) in one
  loop with a hand-written backward, and combines back weighted by the gates.
  `big = None` (the default) picks it per shape from the mean rows per expert
  (`chunk_rows`: 128 to 512).

  Serves exactly the kept choices of any `Routing` (capacity or dropless, token or
  expert choice): with capacity routing it computes the kept rows only (not the
  empty slots of [E, C] buffers), with dropless routing every choice. Static rows:
  min(g s k, g E C) + `big`. Memory: those rows' outputs and hidden activations,
  O(tokens x k), no copy of the gathered inputs (each chunk gathers its token rows
  and scatters their gradient back). Built for the CPU's matmul (few products of
  >= 128 rows); one device: under a mesh that splits the experts use the
  expert-parallel dispatchers.

  Gin: `MoeConfig.dispatcher = @BlockDispatcher()`, `BlockDispatcher.big = 256`.
  """

  big: Optional[int] = None
  small: int = 16

  def __call__(self, x_gsd: jax.Array, routing: Routing,
               weights: ExpertWeights) -> jax.Array:
    g, s, d = x_gsd.shape
    num_experts = weights.num_experts
    num_rows = max_kept_rows(routing, g * s, num_experts)
    big = self.big or chunk_rows(num_rows / num_experts)
    # Rows: the kept choices, then spare rows up to num_rows + `big` (chunks may run
    # past the last kept row) reading a zero token with a zero gate. Unkept choices
    # point past the end: they move nothing.
    num_padded = num_rows + big
    row_gsk, layout = block_rows(routing, num_experts, num_padded)
    token_gsk = jnp.broadcast_to(jnp.arange(g * s, dtype=jnp.int32).reshape(g, s, 1),
                                 row_gsk.shape)
    to_rows = lambda values, fill: jnp.full((num_padded,), fill, values.dtype).at[
        row_gsk.reshape(-1)].set(values.reshape(-1), mode="drop")
    source_p = to_rows(token_gsk, g * s)
    gate_p = to_rows(routing.gates.astype(jnp.float32), 0.0)
    x_nd = jnp.concatenate([x_gsd.reshape(g * s, d), jnp.zeros((1, d), x_gsd.dtype)])
    out_nd = chunked_expert_ffn(x_nd, source_p, gate_p, weights.wi_0, weights.wi_1,
                                weights.wo, layout, ChunkSizes(big, self.small),
                                weights.kind)
    return out_nd[:g * s].reshape(g, s, d)
