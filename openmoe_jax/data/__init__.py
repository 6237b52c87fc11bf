"""Data: embedded corpus, vocabulary, seqio pipeline (import the submodules).

Left empty so `import openmoe_jax.data.corpus` does not pull in TensorFlow.
"""
