"""Decoding from a trained Decoder: autoregressive.py (KV cache; greedy, temperature,
top-p) for causal LM and UL2 models, diffusion.py (LLaDA-style iterative unmasking)
for masked-diffusion models, and serving.py (the model config both sample with).
`openmoe-sample` (cli/sample.py) picks one by the run's objective
(`objectives.is_diffusion`).
"""
