"""Conversion time and peak host memory of `openmoe-convert from-t5x` at OpenMoE-Base
size (12 layers, d 768, 16 experts every 4th layer, vocabulary 256,384: 0.65B
parameters), on a synthetic t5x checkpoint in t5x's on-disk layout.

  python benchmarks/convert_base.py [--workdir=/tmp/convert_base] [--keep]

Prints the checkpoint size, the conversion's wall time and its peak resident set
(ru_maxrss of the converting subprocess), beside the model's float32 size, so the
ratio says how many copies of the model the converter holds at once.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from t5x_format import write_t5x_checkpoint  # noqa: E402  pylint: disable=g-import-not-at-top

D, HEADS, HEAD_DIM, F, E, V, LAYERS, INTERVAL = 768, 12, 64, 2048, 16, 256384, 12, 4


def base_weights(rng):
  """Yields (t5x name, array) of a random OpenMoE-Base (one array at a time)."""
  normal = lambda *s: rng.standard_normal(s, np.float32) * 0.02
  yield "token_embedder/embedding", normal(V, D)
  yield "decoder/decoder_norm/scale", np.ones(D, np.float32)
  yield "decoder/logits_dense/kernel", normal(D, V)
  for i in range(LAYERS):
    p = f"decoder/layers_{i}/"
    yield p + "pre_self_attention_layer_norm/scale", np.ones(D, np.float32)
    for n in ("query", "key", "value"):
      yield p + f"self_attention/{n}/kernel", normal(D, HEADS * HEAD_DIM)
    yield p + "self_attention/out/kernel", normal(HEADS * HEAD_DIM, D)
    yield p + "pre_mlp_layer_norm/scale", np.ones(D, np.float32)
    mlp = "mlp"
    if (i + 1) % INTERVAL == 0:
      yield p + "mlp/router/router_weights/w/kernel", normal(D, E)
      yield p + "mlp/expert/wi_0/kernel", normal(E, D, 2 * F)
      yield p + "mlp/expert/wi_1/kernel", normal(E, D, F)
      yield p + "mlp/expert/wo/kernel", normal(E, F, D)
      yield p + "pre_extra_mlp_layer_norm/scale", np.ones(D, np.float32)
      mlp = "extra_mlp"
    yield p + f"{mlp}/wi_0/kernel", normal(D, 2 * F)
    yield p + f"{mlp}/wi_1/kernel", normal(D, F)
    yield p + f"{mlp}/wo/kernel", normal(F, D)


_CONVERT = """
import resource, sys, time
from openmoe_jax.cli import convert
start = time.time()
convert.run(sys.argv[1:], say=lambda _: None)
print(time.time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def main() -> int:
  """Writes the checkpoint, converts it in a subprocess, prints the figures."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default="/tmp/openmoe_convert_base")
  parser.add_argument("--keep", action="store_true", help="keep the files written")
  args = parser.parse_args()
  shutil.rmtree(args.workdir, ignore_errors=True)
  ckpt = os.path.join(args.workdir, "t5x")
  start = time.time()
  weights = dict(base_weights(np.random.default_rng(0)))
  num_params = sum(w.size for w in weights.values())
  write_t5x_checkpoint(ckpt, 500000, weights)
  del weights
  print(f"wrote a synthetic OpenMoE-Base t5x checkpoint: {num_params / 1e9:.3f}B "
        f"parameters ({num_params * 4 / 2**30:.2f} GiB float32) in {time.time() - start:.0f} s")
  gin = ["--gin_file=models/openmoe_base_16e.gin"]
  out = os.path.join(args.workdir, "export")
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  result = subprocess.run(
      [sys.executable, "-c", _CONVERT, "from-t5x", f"--checkpoint={ckpt}",
       f"--output={out}", *gin], env=env, capture_output=True, text=True, check=False)
  if result.returncode:
    print(result.stderr[-3000:])
    return 1
  seconds, max_rss_kib = map(float, result.stdout.split()[-2:])
  peak_gib, model_gib = max_rss_kib / 2**20, num_params * 4 / 2**30
  print(f"from-t5x: {seconds:.1f} s, peak RSS {peak_gib:.2f} GiB = "
        f"{peak_gib / model_gib:.2f} x the float32 model ({model_gib:.2f} GiB)")
  if not args.keep:
    shutil.rmtree(args.workdir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
