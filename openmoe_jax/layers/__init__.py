"""Transformer building blocks: attention, gated MLPs, norms, embeddings."""
