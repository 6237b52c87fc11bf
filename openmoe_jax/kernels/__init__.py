"""Kernels under the dispatchers, each with a Pallas TPU path and an XLA fallback.

- grouped_matmul.py: grouped matmul with backends "pallas" (pallas_gmm.py: megablox
  gmm / tgmm TPU kernels, interpret mode off TPU), "ragged_dot" (`jax.lax.ragged_dot`)
  and "padded" (tile-padded XLA loop, the CPU path).
- block_mlp.py: each expert's whole gated MLP over its contiguous rows in large row
  chunks, with a hand-written backward (the CPU engine of BlockDispatcher).
- permute.py: gather tokens into expert order and combine them back; Pallas row-DMA
  kernels on TPU (permute_pallas.py), an XLA gather elsewhere.
- target.py: which device the kernels are traced for (the attached one, or a TPU
  compile target for ahead-of-time compiles).
"""
