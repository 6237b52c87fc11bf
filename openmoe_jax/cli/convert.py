"""openmoe-convert: checkpoints in (t5x, Hugging Face) and out (Hugging Face, params).

  openmoe-convert from-t5x --checkpoint=DIR --gin_file=models/openmoe_base_16e.gin --output=DIR
  openmoe-convert from-hf  --checkpoint=DIR --gin_file=... --output=DIR [--layout=L]
  openmoe-convert to-hf    --model_dir=DIR --output=DIR --layout=openmoe|mixtral|qwen3_moe
  openmoe-convert params   --model_dir=DIR --output=DIR [--dtype=bfloat16]

Imports write a params export (convert/params_export.py): `openmoe-eval`,
`openmoe-sample` and `load_model` read it, and `openmoe-train` with it as MODEL_DIR
continues from it with a fresh optimizer state.
"""
import argparse
import os
import sys
import time
from typing import Callable, List, Optional, Sequence

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from openmoe_jax import gin_utils, run_loader
from openmoe_jax.cli import flags
from openmoe_jax.config import ModelConfig, build_model_config
from openmoe_jax.convert import hf_io, hf_native, params_export, registry
from openmoe_jax.convert.layout import ConversionError
from openmoe_jax.convert.t5x_reader import T5xCheckpoint
from openmoe_jax.data import pipeline
from openmoe_jax.model import Decoder

EXAMPLES_LIST = [
    "openmoe-convert from-t5x --checkpoint=/ckpt/openmoe_base/checkpoint_500000 "
    "--gin_file=models/openmoe_base_16e.gin --output=/tmp/openmoe_base",
    "openmoe-convert to-hf --model_dir=/tmp/openmoe_quickstart --layout=openmoe "
    "--output=/tmp/hf",
    "openmoe-convert params --model_dir=/tmp/openmoe_quickstart --output=/tmp/export "
    "--dtype=bfloat16",
]


def _program() -> flags.Program:
  program = flags.Program(
      "openmoe-convert", "Convert checkpoints into and out of openmoe_jax: t5x "
      "(OpenMoE's released JAX weights) and Hugging Face in; Hugging Face and "
      "params-only Orbax exports out. `openmoe-convert COMMAND --help` shows a "
      "command's flags.", EXAMPLES_LIST, gin=True,
      details="gin flags apply to from-t5x and from-hf: the gin files describe the "
      "model exactly as for openmoe-train\n(a run gin that names the task also "
      "carries the vocabulary).")
  parser = program.parser
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  t5x = sub.add_parser("from-t5x", help="t5x checkpoint -> params export",
                       description="Read a t5x checkpoint folder (checkpoint_<step>/ or "
                       "its parent: the newest step) and write a params export.")
  t5x.add_argument("--checkpoint", required=True, help="t5x checkpoint folder")
  hf_in = sub.add_parser("from-hf", help="Hugging Face folder -> params export",
                         description="Read a Hugging Face safetensors folder in one of "
                         f"the layouts {sorted(registry.HF_LAYOUTS)} and write a params export.")
  hf_in.add_argument("--checkpoint", required=True, help="Hugging Face folder")
  hf_in.add_argument("--layout", choices=sorted(registry.HF_LAYOUTS),
                     help="default: read from config.json's model_type/architectures")
  for p in (t5x, hf_in):
    p.add_argument("--output", required=True, help="params export folder to create")
    p.add_argument("--step", type=flags.int_at_least(0), default=0,
                   help="step the export (and a run continuing from it) starts at")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  hf_out = sub.add_parser("to-hf", help="MODEL_DIR or params export -> Hugging Face",
                          description="Write a Hugging Face folder: safetensors shards, "
                          "config.json and the tokenizer.")
  hf_out.add_argument("--layout", required=True, choices=sorted(registry.HF_LAYOUTS))
  hf_out.add_argument("--max_shard_gb", type=flags.float_in(0.0, low_open=True),
                      default=2.0)
  export = sub.add_parser("params", help="MODEL_DIR -> params export",
                          description="Write a params-only Orbax export (no optimizer "
                          "state) of a run's checkpoint.")
  export.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                      help="cast parameters (default: as trained)")
  for p in (hf_out, export):
    p.add_argument("--model_dir", required=True,
                   help="training MODEL_DIR or params export")
    p.add_argument("--output", required=True, help="folder to create")
    p.add_argument("--step", type=flags.int_at_least(0), default=None,
                   help="default: the newest")
  for p in sub.choices.values():
    p.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
  return program


def _model_from_gin(files: Sequence[str], bindings: Sequence[str], paths: Sequence[str]
                    ) -> ModelConfig:
  """Returns the ModelConfig the gin flags describe (vocabulary from the task if
  one is named, else ModelConfig.vocab_size)."""
  if not files:
    raise ConversionError("--gin_file is required: the gin model to load into")
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(files, bindings, paths, finalize=False)
  task = run_loader.query("train.mixture_or_task_name")
  if task:
    return build_model_config(None, pipeline.vocabulary_for(task).vocab_size)
  cfg = ModelConfig()
  if cfg.vocab_size is None:
    raise ConversionError("the gin files name no task (train.mixture_or_task_name) "
                          "and bind no ModelConfig.vocab_size")
  return cfg


def _abstract_params(cfg: ModelConfig):
  """Returns the model's parameter tree as ShapeDtypeStructs (no memory)."""
  tokens = jnp.zeros((1, 8), jnp.int32)
  boxed = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), tokens)["params"]
  return nn.unbox(boxed)


def _check_output(output: str) -> None:
  if os.path.exists(output) and os.listdir(output):
    raise ConversionError(f"--output {output} exists and is not empty; pick a new folder")


def _import(reader, layout, args, files, bindings, paths, say) -> None:
  cfg = _model_from_gin(files, bindings, paths)
  registry.check(cfg, layout)
  _check_output(args.output)
  say(f"Reading {len(reader.names)} tensors in the {layout.name!r} layout "
      f"({cfg.num_layers} layers, {sum(cfg.sparse_layers())} MoE)")
  params = hf_native.import_hf_tensors(reader.read, reader.names, cfg, layout,
                                       _abstract_params(cfg), progress=say)
  say(f"Writing the params export to {args.output}")
  params_export.save(args.output, params, args.step, gin.config_str(),
                     source=f"{args.command} {os.path.abspath(args.checkpoint)}",
                     dtype=None if args.dtype == "float32" else args.dtype)


def _load_run_params(model_dir: str, step: Optional[int]):
  run = run_loader.load_run(model_dir)
  step = run_loader.pick_step(run, step)
  return run, step, jax.tree.map(np.asarray, nn.unbox(
      run_loader.restore_params(model_dir, step)))


def _to_hf(args, say) -> None:
  layout, hf_config = registry.HF_LAYOUTS[args.layout]
  run, step, params = _load_run_params(args.model_dir, args.step)
  registry.check(run.config, layout)
  _check_output(args.output)
  say(f"Writing {args.layout} layout of step {step} to {args.output}")
  files = hf_io.write_safetensors(
      args.output, hf_native.export_hf_tensors(params, run.config, layout),
      max_shard_bytes=int(args.max_shard_gb * 2**30), progress=say)
  hf_io.write_config(args.output, hf_config(run.config))
  if run.mixture_or_task_name:
    files += hf_io.write_tokenizer(args.output,
                                   pipeline.vocabulary_for(run.mixture_or_task_name),
                                   run.sequence_length)
  say(f"Wrote {', '.join(files)} and config.json")


def _params(args, say) -> None:
  run, step, params = _load_run_params(args.model_dir, args.step)
  _check_output(args.output)
  with open(os.path.join(args.model_dir, "config.gin")) as f:
    config_gin = f.read()
  params_export.save(args.output, params, step, config_gin,
                     source=f"params {os.path.abspath(args.model_dir)}", dtype=args.dtype)
  say(f"Wrote the params export of step {step} ({run.config.num_layers} layers) to "
      f"{args.output}")


def run(argv: Sequence[str], say: Callable[[str], None] = print) -> None:
  """Runs one openmoe-convert command; raises ConversionError/GinConfigError/
  FileNotFoundError with a one-line message on bad input (nothing written)."""
  args, gin_flags = _program().parse(argv)
  _execute(args, gin_flags, say)


def _execute(args, gin_flags: flags.GinFlags, say: Callable[[str], None]) -> int:
  """Runs the parsed command; returns 0."""
  files, bindings, paths = gin_flags.files, gin_flags.bindings, gin_flags.search_paths
  start = time.time()
  if args.command == "from-t5x":
    _import(T5xCheckpoint(args.checkpoint), registry.T5X, args, files, bindings, paths,
            say)
  elif args.command == "from-hf":
    reader = hf_io.SafetensorsReader(args.checkpoint)
    layout_name = args.layout or registry.layout_of(hf_io.read_config(args.checkpoint))
    _import(reader, registry.HF_LAYOUTS[layout_name][0], args, files, bindings, paths,
            say)
  elif args.command == "to-hf":
    _to_hf(args, say)
  else:
    _params(args, say)
  say(f"Done in {time.time() - start:.1f} s")
  return 0


def main(argv: Optional[List[str]] = None) -> int:
  """Console entry point: returns 0, or 2 after one error line on bad input."""
  return _program().main(lambda args, gin_flags: _execute(args, gin_flags, print), argv)


if __name__ == "__main__":
  sys.exit(main())
