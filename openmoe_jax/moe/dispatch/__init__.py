"""Dispatchers: move routed tokens to their experts and combine the outputs back.

One contract (base.py): `dispatcher(x_gsd, routing, weights) -> y_gsd` with
`weights` an `ExpertWeights`; shared pieces in primitives.py (and buffers.py for the
capacity-buffer ones). One module per dispatcher:

- einsum.py `EinsumDispatcher`, sort.py `SortDispatcher`: [E, g, C, d] buffers;
- ragged.py `RaggedDispatcher`: sorted rows and grouped matmuls (dropless-capable);
- block.py `BlockDispatcher`: rows packed per expert, one chunked expert-MLP loop
  (the CPU engine, capacity and dropless);
- all_to_all.py `AllToAllDispatcher`, ragged_all_to_all.py
  `RaggedAllToAllDispatcher`: expert parallelism under shard_map;
- auto.py `AutoDispatcher` (the default): picks one per platform and size.

Importing this package registers every dispatcher with gin, so that a gin file or a
command-line binding (`--gin.MoeConfig.dispatcher=@SortDispatcher()`) can name any.
"""
from openmoe_jax.moe.dispatch.all_to_all import AllToAllDispatcher
from openmoe_jax.moe.dispatch.auto import AutoDispatcher
from openmoe_jax.moe.dispatch.base import Dispatcher, ExpertWeights
from openmoe_jax.moe.dispatch.block import BlockDispatcher
from openmoe_jax.moe.dispatch.einsum import EinsumDispatcher
from openmoe_jax.moe.dispatch.ragged import RaggedDispatcher
from openmoe_jax.moe.dispatch.ragged_all_to_all import RaggedAllToAllDispatcher
from openmoe_jax.moe.dispatch.sort import SortDispatcher

__all__ = ["AllToAllDispatcher", "AutoDispatcher", "BlockDispatcher", "Dispatcher",
           "EinsumDispatcher", "ExpertWeights", "RaggedAllToAllDispatcher",
           "RaggedDispatcher", "SortDispatcher"]
