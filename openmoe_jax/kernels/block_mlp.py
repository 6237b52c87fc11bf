"""Chunked expert MLP: each expert's whole gated MLP over its contiguous rows, in
row chunks sized for the CPU's matmul, forward and a hand-written backward.

`chunked_expert_ffn(x_nd, source_p, gate_p, wi_0, wi_1, wo, layout, sizes, kind)`
is dispatch, experts and combine in one loop: row p reads token source_p[p], goes
through the MLP of the expert that owns it (expert e owns rows [start_e[e],
start_e[e] + rows_e[e]), experts in order, no padding between them, `sizes.big`
spare rows past the last one) and is added to its token's output weighted by
gate_p[p]. It is the CPU engine of `BlockDispatcher` (moe/dispatch/block.py).

How the rows are cut (`ChunkSizes(big, small)`): an expert's rows go through the
MLP in chunks of `big` rows while at least `big` remain; the rest, rounded up to
`small`, takes one more `big` chunk when over big / 2, else chunks of big / 2,
big / 4, ..., `small` rows (each size at most once: the binary digits of the
rest). A matmul of 16-32 rows runs at about half the speed of one of 128 rows on
a CPU (the weight is packed per product), so few, large products win; padding
every expert to a multiple of a large tile would waste up to that tile per expert.
A chunk may run past its expert's last row: those rows belong to the next experts
(or the spare rows), are computed with this expert's weights, written (then
overwritten when their own expert's chunks run, since experts run in order) but
get a zero gate, so they add nothing to any token. The backward does the same and
zeroes their output cotangent, so they add nothing to this expert's gradients.

Each expert's weights are sliced once (outer loop over experts); a chunk gathers its
token rows, runs the products (wi_0, wi_1, the gate, wo) back to back on rows in
cache and scatter-adds its gate-weighted outputs to the tokens, so no [rows, d]
copy of the inputs and no [tokens, k, d] gather of the outputs exists. The forward
keeps only the rows' hidden activations (h0, h1) for the backward, which gathers
each chunk's output cotangent from the tokens, gives the gates their gradient (the
output row . its cotangent, computed as a . (cotangent @ wo^T), the product that
gives a its cotangent anyway, so the rows' outputs are not kept: d fewer values per
row), scatter-adds the input gradient to the tokens, and adds the chunk's weight
gradients to its expert's slice of the [E, d, f] float32 gradients, which the loop
over experts carries and updates in place. (Accumulating in a per-expert [d, f]
carry and stacking the experts' results, as a scan over experts does, writes
every expert's gradients once more: benchmarks/moe_layer.py's block path at
(d 768, f 2048, E 16, k 2, 4096 tokens) went from 1.26x to 1.19x of the dense
MLP's time, and from 2.44x / 3.03x to 2.32x / 2.72x at E 64 / E 256, on a
2-core Intel Xeon; gradients bit for bit the same.)
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from openmoe_jax.layers.mlp import gated_hidden


class ChunkSizes(NamedTuple):
  """Rows per product: `big` for the bulk, down to `small` (powers of two)."""

  big: int
  small: int


class ExpertRows(NamedTuple):
  """Expert e owns rows [start_e[e], start_e[e] + rows_e[e]) (int32 [E] each)."""

  start_e: jax.Array
  rows_e: jax.Array


def expert_rows(rows_e: jax.Array) -> ExpertRows:
  """Returns the layout of experts holding `rows_e` rows each, back to back."""
  rows_e = rows_e.astype(jnp.int32)
  return ExpertRows(jnp.cumsum(rows_e) - rows_e, rows_e)


def _dot(a, b, contract):
  """Returns the float32-accumulated product of a and b over dims `contract`."""
  return jax.lax.dot_general(a, b, (contract, ((), ())),
                             preferred_element_type=jnp.float32)


def _chunk_plan(sizes: ChunkSizes):
  """Returns the remainder chunk sizes, largest first: big/2, big/4, ..., small."""
  plan, size = [], sizes.big // 2
  while size >= sizes.small:
    plan.append(size)
    size //= 2
  return plan


def _owned(row, size: int, end) -> jax.Array:
  """Returns [size] bool: which rows of the chunk at `row` lie before `end`, i.e.
  belong to the expert whose rows end there (the rest are run-past rows)."""
  return row + jnp.arange(size) < end


def _for_chunks(start, rows, sizes: ChunkSizes, step, state):
  """Runs state = step(size, row, state) over the chunks of rows [start, start +
  rows) (module docstring) in row order; returns the final state. Chunks that may
  or may not run are loops of 0 or 1 trips, not conditionals: a loop updates its
  carry in place, where XLA's conditionals copy the large row buffers."""
  big = sizes.big

  def run(size, first_row, count, state):
    return jax.lax.fori_loop(
        0, count, lambda i, st: step(size, first_row + i * size, st), state)

  full = rows // big
  rest = (rows - full * big + sizes.small - 1) // sizes.small * sizes.small
  row = start + full * big
  state = run(big, start, full + (rest > big // 2), state)
  rest = jnp.where(rest > big // 2, 0, rest)
  for size in _chunk_plan(sizes):
    take = (rest & size) > 0
    state = run(size, row, take.astype(jnp.int32), state)
    row = row + jnp.where(take, size, 0)
  return state


def _forward(x_nd, source_p, gate_p, wi_0, wi_1, wo, layout, sizes, kind):
  """Returns (out_nd, h0_pf, h1_pf): the gate-weighted sum of each token's rows
  and every row's hidden activations, which the backward reads."""
  p = source_p.shape[0]
  state = (jnp.zeros_like(x_nd), jnp.zeros((p, wi_0.shape[-1]), x_nd.dtype),
           jnp.zeros((p, wi_1.shape[-1]), x_nd.dtype))

  def expert(e, state):
    w0, w1, w2 = wi_0[e], wi_1[e], wo[e]
    end = layout.start_e[e] + layout.rows_e[e]

    def step(size, row, state):
      out_nd, h0_pf, h1_pf = state
      source_t = jax.lax.dynamic_slice_in_dim(source_p, row, size)
      x_td = x_nd[source_t]
      h0 = _dot(x_td, w0, ((1,), (0,))).astype(x_nd.dtype)
      h1 = _dot(x_td, w1, ((1,), (0,))).astype(x_nd.dtype)
      y_td = _dot(gated_hidden(kind, h0, h1), w2, ((1,), (0,))).astype(x_nd.dtype)
      # Rows past the expert's are added by their own expert.
      gate_t = jnp.where(_owned(row, size, end),
                         jax.lax.dynamic_slice_in_dim(gate_p, row, size), 0)
      out_nd = out_nd.at[source_t].add(y_td * gate_t[:, None].astype(y_td.dtype))
      put = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, row, 0)
      return out_nd, put(h0_pf, h0), put(h1_pf, h1)

    return _for_chunks(layout.start_e[e], layout.rows_e[e], sizes, step, state)

  return jax.lax.fori_loop(0, wo.shape[0], expert, state)


def _backward(x_nd, source_p, gate_p, h0_pf, h1_pf, dout_nd, wi_0, wi_1, wo,
              layout, sizes, kind):
  """Returns (dx_nd, dgate_p, dwi_0, dwi_1, dwo)."""
  def expert(e, state):
    w0, w1, w2 = wi_0[e], wi_1[e], wo[e]
    end = layout.start_e[e] + layout.rows_e[e]

    def step(size, row, state):
      dx_nd, dgate_p, dw0, dw1, dw2 = state
      take = lambda a: jax.lax.dynamic_slice_in_dim(a, row, size)
      source_t = take(source_p)
      x_td, h0, h1, dout_td = x_nd[source_t], take(h0_pf), take(h1_pf), dout_nd[source_t]
      # Rows past the expert's: no gradient here (their own expert writes theirs).
      mine_t = _owned(row, size, end)
      gate_t = jnp.where(mine_t, take(gate_p), 0)
      dy_td = dout_td * gate_t[:, None].astype(dout_td.dtype)
      a_tf, gate_vjp = jax.vjp(functools.partial(gated_hidden, kind), h0, h1)
      # The chunk's weight gradients are added to expert e's slice of the [E, ...]
      # float32 gradients in place (the loop carries them).
      dw2 = dw2.at[e].add(_dot(a_tf, dy_td, ((0,), (0,))))
      # The row's output y = a @ w2 is not kept: its gate's gradient y . dout is
      # a . (dout @ w2^T), and dout @ w2^T x gate is a's cotangent.
      da_tf = _dot(dout_td, w2, ((1,), (1,)))
      dgate_t = jnp.where(mine_t, jnp.sum(a_tf.astype(jnp.float32) * da_tf, axis=-1), 0)
      dh0, dh1 = gate_vjp((da_tf * gate_t[:, None]).astype(dy_td.dtype))
      dw0 = dw0.at[e].add(_dot(x_td, dh0, ((0,), (0,))))
      dw1 = dw1.at[e].add(_dot(x_td, dh1, ((0,), (0,))))
      dx_td = _dot(dh0, w0, ((1,), (1,))) + _dot(dh1, w1, ((1,), (1,)))
      dgate_p = jax.lax.dynamic_update_slice_in_dim(
          dgate_p, dgate_t.astype(dgate_p.dtype), row, 0)
      return dx_nd.at[source_t].add(dx_td.astype(dx_nd.dtype)), dgate_p, dw0, dw1, dw2

    return _for_chunks(layout.start_e[e], layout.rows_e[e], sizes, step, state)

  weights = (wi_0, wi_1, wo)
  state = (jnp.zeros_like(x_nd), jnp.zeros_like(gate_p)) + tuple(
      jnp.zeros(w.shape, jnp.float32) for w in weights)
  dx_nd, dgate_p, *grads = jax.lax.fori_loop(0, wo.shape[0], expert, state)
  return (dx_nd, dgate_p) + tuple(g.astype(w.dtype) for g, w in zip(grads, weights))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _chunked_ffn(x_nd, source_p, gate_p, wi_0, wi_1, wo, layout, sizes, kind):
  return _forward(x_nd, source_p, gate_p, wi_0, wi_1, wo, layout, sizes, kind)[0]


def _chunked_ffn_fwd(x_nd, source_p, gate_p, wi_0, wi_1, wo, layout, sizes, kind):
  out_nd, h0_pf, h1_pf = _forward(x_nd, source_p, gate_p, wi_0, wi_1, wo, layout,
                                  sizes, kind)
  return out_nd, (x_nd, source_p, gate_p, h0_pf, h1_pf, wi_0, wi_1, wo, layout)


def _chunked_ffn_bwd(sizes, kind, res, dout_nd):
  x_nd, source_p, gate_p, h0_pf, h1_pf, wi_0, wi_1, wo, layout = res
  dx_nd, dgate_p, dwi_0, dwi_1, dwo = _backward(
      x_nd, source_p, gate_p, h0_pf, h1_pf, dout_nd.astype(x_nd.dtype), wi_0,
      wi_1, wo, layout, sizes, kind)
  no_grad = lambda tree: jax.tree.map(
      lambda a: jnp.zeros(a.shape, jax.dtypes.float0), tree)
  return dx_nd, no_grad(source_p), dgate_p, dwi_0, dwi_1, dwo, no_grad(layout)


_chunked_ffn.defvjp(_chunked_ffn_fwd, _chunked_ffn_bwd)


def chunked_expert_ffn(x_nd: jax.Array, source_p: jax.Array, gate_p: jax.Array,
                       wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array,
                       layout: ExpertRows, sizes: ChunkSizes, kind: str) -> jax.Array:
  """Returns out [n, d]: out[i] = sum over the rows p with source_p[p] = i of
  gate_p[p] x (token i through the gated MLP of the expert that owns row p)
  (wi_0 [E, d, F0], wi_1 [E, d, F], wo [E, F, d]). Rows past the last expert's
  (source_p must hold `sizes.big` of them, e.g. pointing at a zero token, with any
  gate) add nothing."""
  return _chunked_ffn(x_nd, source_p, gate_p, wi_0, wi_1, wo, layout, sizes, kind)
