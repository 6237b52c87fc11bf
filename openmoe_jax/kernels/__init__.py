"""Kernels under the dispatchers: grouped matmul backends (XLA today; Pallas next)."""
