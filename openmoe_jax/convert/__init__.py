"""Checkpoints in and out: t5x (OpenMoE's released JAX weights), Hugging Face
layouts (OpenMoE's port, Mixtral, Qwen3-MoE) and params-only Orbax exports.

`layout.py` is the one engine (rules between our tree and flat external names,
placed through `model.layer_slots`); one module per external layout; `cli.py` is
`openmoe-convert`.
"""
