"""The compiled train step of a gin-configured run, and variants of it, side by side.

Usage: python benchmarks/train_step.py [--gin_file=runs/quickstart.gin] [--gin.K=V ...]
           [--variant 'NAME:BINDING[;BINDING...]' ...] [--data] [--rounds N] [--json]

Example (the quickstart's choices, README "Quickstart"):
  python benchmarks/train_step.py --gin_file=runs/quickstart.gin \\
    --variant 'einsum:MoeConfig.dispatcher=@EinsumDispatcher()' \\
    --variant 'scanned:ModelConfig.scan_layers=True'

The baseline is the run the gin files and `--gin.` bindings describe (default: the
quickstart); each `--variant` adds its bindings to it. Every path is built and
compiled first (its model, objective and optimizer from gin, as `openmoe-train`
builds them; the vocabulary size from the run's task, or ModelConfig.vocab_size,
or `--vocab_size`), then timed with benchmarks/timing.py's method: each variant
in pairs with the baseline alone (baseline, variant, ... `--rounds` timed pairs
after `--warmup` untimed ones), so load that drifts hits both sides of a pair. A
step is `Trainer.train_step` on one synthetic batch of random tokens (every target
counts, one segment per row), host-to-device copy of the batch included, as the
training loop calls it; the data pipeline, logging and checkpoints are not.
`--data` adds the path 'data': the baseline's own compiled step and state fed by the
run's input pipeline (its task's training split, as `openmoe-train` reads it), in
pairs with the baseline like a variant, so its ratio is what the pipeline (its
`next()`, and its threads producing the next batch while the step runs on the same
cores) costs the step.

Per path: `step_ms` is the median of its step times, `step_ms_min` / `_max` their
spread (the baseline's over every pair it ran in); `ratio_to_base` the MEDIAN OF
THE PER-PAIR RATIOS variant / baseline, with its spread; `tokens_per_s` = batch
tokens / median step; `mfu` = tokens/s x `model_flops_per_token`
(`flops.model_flops_per_token`, the trainer's `train/mfu` convention) / the faster
of two matmul peaks measured in this process, one before the paths are built
(`peak_flops_start`) and one after the timing (`peak_flops_end`); `first_loss` is
the first step's loss (every path starts from the same seed, so variants of the
same model, a dispatcher say, show the same), `loss` the last step's (paths run
different numbers of steps on the one batch). With no variant the baseline is timed
alone (`rounds` steps). The load average at the start and the end goes in every row. On the CPU the
allocator setting of the library's programs applies (cli/host_malloc.py), as in
`openmoe-train`.
"""
import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openmoe_jax.cli import environment, host_malloc  # noqa: E402  (no jax)

if __name__ == "__main__" and environment.runs_on_cpu():
  # Before jax allocates anything: freed buffers are reused, as in openmoe-train.
  print(f"malloc: reuse freed memory {host_malloc.reuse_freed_memory()} "
        "(OPENMOE_MALLOC=default: glibc's defaults)", file=sys.stderr)

import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import timing  # noqa: E402
from openmoe_jax import flops, gin_utils, partitioning, run_loader  # noqa: E402
from openmoe_jax.config import ModelConfig, build_model_config  # noqa: E402
from openmoe_jax.model import Decoder  # noqa: E402
from openmoe_jax.objectives import CausalLm  # noqa: E402
from openmoe_jax.trainer import Trainer  # noqa: E402

DEFAULT_GIN_FILE = "runs/quickstart.gin"
BASE = "base"
DATA = "data"  # the path --data adds
_VARIANT = re.compile(r"^([A-Za-z0-9_.-]+):(.+)$", re.S)


class RunConfigError(ValueError):
  """The gin run lacks what a step needs (batch size, vocabulary size, optimizer)."""


def parse_variant(text: str) -> Tuple[str, List[str]]:
  """Returns (name, gin bindings) of 'NAME:BINDING[;BINDING...]' (argparse type)."""
  match = _VARIANT.match(text.strip())
  bindings = [] if not match else [b.strip() for b in match.group(2).split(";")]
  if not match or not all(bindings) or any("=" not in b for b in bindings):
    raise argparse.ArgumentTypeError(
        "a variant is NAME:BINDING[;BINDING...] (NAME: letters, digits, _ . -; a "
        f"binding: Configurable.param=value), e.g. 'scanned:ModelConfig.scan_layers="
        f"True'; got {text!r}")
  return match.group(1), bindings


class StepPath:
  """One configuration's compiled train step on its synthetic batch; calling it
  runs one step (the state is donated and replaced)."""

  def __init__(self, name: str, bindings: Sequence[str], cfg: ModelConfig, trainer,
               batch_size: int, length: int):
    self.name, self.bindings, self.cfg, self.trainer = name, list(bindings), cfg, trainer
    self.batch_size, self.length = batch_size, length
    self.batch = timing.synthetic_batch(cfg.vocab_size, batch_size, length)
    self.rng = jax.random.PRNGKey(1)
    self.state = trainer.init_state(jax.random.PRNGKey(0))
    self.metrics = None
    self.flops_per_token = flops.model_flops_per_token(
        cfg, length, batch_tokens=batch_size * length)["total"]
    start = time.perf_counter()
    # Compile, then one more step: a retrace (committed-ness of the donated state)
    # happens now, while this path's gin config is the live one.
    self.first_loss = float(self()["loss"])
    self()
    self.compile_s = time.perf_counter() - start

  def __call__(self):
    return self.step(self.batch)

  def step(self, batch):
    """Runs one step on `batch` (state replaced); returns and keeps its metrics."""
    with partitioning.activate(self.trainer.mesh):
      self.state, self.metrics = self.trainer.train_step(self.state, batch, self.rng)
    return self.metrics


class DataPath:
  """The baseline's compiled step and state fed by the run's input pipeline (the
  training split of its task, as `openmoe-train` reads it) instead of the synthetic
  batch: a call takes the next batch (`next()` and the host-to-device copy inside
  the timed call, the pipeline's background threads producing the one after, as in
  the training loop). Paired with the baseline, the ratio is what the input
  pipeline costs the step. `first_loss` is its first step's, on a real batch."""

  def __init__(self, base: StepPath, batches):
    self.base, self.batches = base, batches
    self.name, self.bindings = DATA, base.bindings
    self.cfg, self.trainer = base.cfg, base.trainer
    self.batch_size, self.length = base.batch_size, base.length
    self.flops_per_token, self.compile_s = base.flops_per_token, 0.0
    self.metrics = None
    self.first_loss = float(self()["loss"])

  def __call__(self):
    self.metrics = self.base.step(next(self.batches))
    return self.metrics


def data_path(base: StepPath) -> DataPath:
  """Returns the DataPath of `base`; reads the task and seed from the live gin config
  (base's). Raises RunConfigError when the run names no task or its model's
  vocabulary is smaller than the task's."""
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  task = run_loader.query("train.mixture_or_task_name")
  if task is None:
    raise RunConfigError("--data: the run names no task (train.mixture_or_task_name)")
  vocab_size = pipeline.vocabulary_for(task).vocab_size
  if base.cfg.vocab_size < vocab_size:
    raise RunConfigError(f"--data: the model's vocabulary ({base.cfg.vocab_size}) is "
                         f"smaller than {task}'s ({vocab_size})")
  seed = run_loader.query("train.seed") or 0
  return DataPath(base, pipeline.get_dataset(task, base.length, base.batch_size,
                                             seed=seed))


def build_path(name: str, gin_files: Sequence[str], bindings: Sequence[str],
               search_paths: Sequence[str], batch_size: Optional[int],
               length: Optional[int], vocab_size: Optional[int]) -> StepPath:
  """Returns the StepPath of gin files + bindings (gin's global config is replaced)."""
  gin.clear_config()
  gin_utils.parse_gin(gin_files, bindings, search_paths, finalize=False)
  batch_size = batch_size or run_loader.query("train.batch_size")
  length = length or run_loader.query("train.sequence_length")
  if not batch_size or not length:
    raise RunConfigError("no batch size or sequence length: bind train.batch_size and "
                     "train.sequence_length in gin or pass --batch_size and "
                     "--sequence_length")
  cfg = ModelConfig()
  if cfg.vocab_size is None and vocab_size is None:
    task = run_loader.query("train.mixture_or_task_name")
    if task is None:
      raise RunConfigError("no vocabulary size: bind ModelConfig.vocab_size or "
                       "train.mixture_or_task_name, or pass --vocab_size")
    from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
    vocab_size = pipeline.vocabulary_for(task).vocab_size
  cfg = build_model_config(cfg, vocab_size or cfg.vocab_size)
  optimizer = run_loader.query("train.optimizer")
  if optimizer is None:
    raise RunConfigError("no optimizer: bind train.optimizer (e.g. runs/train_base.gin)")
  objective = run_loader.query("train.objective") or CausalLm()
  mesh = partitioning.make_mesh(run_loader.query("train.num_devices"))
  with partitioning.activate(mesh):
    trainer = Trainer(Decoder(cfg), objective, optimizer, mesh, length)
    return StepPath(name, bindings, cfg, trainer, batch_size, length)


def time_paths(paths: Sequence[StepPath], rounds: int, warmup: int
               ) -> Dict[str, Tuple[List[float], List[float]]]:
  """Returns {name: (baseline ms per pair, path ms per pair)}; the baseline alone
  (an empty base list) when there is no variant."""
  base, variants = paths[0], paths[1:]
  if not variants:
    for _ in range(warmup):
      jax.block_until_ready(base())
    return {base.name: ([], [timing.call_ms(base) for _ in range(rounds)])}
  return timing.paired_ms(base, {p.name: p for p in variants}, rounds, warmup)


def rows_of(paths: Sequence[StepPath], times, peak_start: float, peak_end: float,
            load_start, load_end, rounds: int) -> List[Dict[str, Any]]:
  """Returns one result row per path (the baseline first)."""
  peak = max(peak_start, peak_end)
  base = paths[0]
  base_ms = ([ms for b, _ in times.values() for ms in b] if len(paths) > 1
             else times[base.name][1])
  rows = []
  for path in paths:
    if path is base:
      ms, ratios = base_ms, None
    else:
      pair_base, ms = times[path.name]
      ratios = timing.per_round_ratios(ms, pair_base)
    tokens_per_s = path.batch_size * path.length / (statistics.median(ms) * 1e-3)
    row = {"path": path.name, "bindings": path.bindings,
           "batch_size": path.batch_size, "sequence_length": path.length,
           **timing.spread(ms, "step_ms"),
           "tokens_per_s": round(tokens_per_s, 1),
           "model_flops_per_token": path.flops_per_token,
           "mfu": round(flops.mfu(tokens_per_s, path.flops_per_token, peak,
                                  flops.peak_devices(path.trainer.mesh)), 6),
           "first_loss": path.first_loss,
           "loss": float(path.metrics["loss"]),
           "compile_s": round(path.compile_s, 1), "rounds": rounds,
           "peak_flops_start": peak_start, "peak_flops_end": peak_end,
           "loadavg_start": load_start, "loadavg_end": load_end}
    if ratios is None:
      row.update({"ratio_to_base": None, "ratio_to_base_min": None,
                  "ratio_to_base_max": None})
    else:
      row.update(timing.spread(ratios, "ratio_to_base"))
    rows.append(row)
  return rows


def run(gin_files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str],
        variants: Sequence[Tuple[str, List[str]]], rounds: int, warmup: int,
        batch_size: Optional[int] = None, length: Optional[int] = None,
        vocab_size: Optional[int] = None, data: bool = False) -> List[Dict[str, Any]]:
  """Builds the baseline, with `data` its DataPath, and each variant, times them
  (module docstring); returns the rows. gin's global config is cleared at the end."""
  gin_utils.import_configurables()
  load_start = timing.load_average()
  peak_start = timing.matmul_peak(jnp.float32)
  paths = []
  try:
    for name, extra in [(BASE, [])] + list(variants):
      print(f"building and compiling {name} ...", file=sys.stderr, flush=True)
      paths.append(build_path(name, gin_files, list(bindings) + extra, search_paths,
                              batch_size, length, vocab_size))
      if name == BASE and data:
        print("opening the run's input pipeline ...", file=sys.stderr, flush=True)
        paths.append(data_path(paths[0]))
  finally:
    gin.clear_config()
  print(f"timing {len(paths)} path(s), {rounds} rounds ...", file=sys.stderr, flush=True)
  times = time_paths(paths, rounds, warmup)
  peak_end = timing.matmul_peak(jnp.float32)
  return rows_of(paths, times, peak_start, peak_end, load_start,
                 timing.load_average(), rounds)


def _print_table(rows: Sequence[Dict[str, Any]]):
  """Prints the rows as a table with a header naming the run's conditions."""
  first = rows[0]
  print(f"# batch {first['batch_size']} x {first['sequence_length']} tokens, "
        f"{first['rounds']} rounds; matmul peak {first['peak_flops_start'] / 1e9:.1f} "
        f"/ {first['peak_flops_end'] / 1e9:.1f} GFLOP/s (start / end); load "
        f"{first['loadavg_start']} -> {first['loadavg_end']}")
  print(f"{'path':16} {'step ms [min-max]':>22} {'tokens/s':>9} {'MFU':>6} "
        f"{'ratio [min-max]':>18} {'step-1 loss':>11}")
  for row in rows:
    ratio = ("base" if row["ratio_to_base"] is None else
             f"{row['ratio_to_base']:.3f} [{row['ratio_to_base_min']:.2f}-"
             f"{row['ratio_to_base_max']:.2f}]")
    step = f"{row['step_ms']:9.1f} [{row['step_ms_min']:.1f}-{row['step_ms_max']:.1f}]"
    print(f"{row['path']:16} {step:22} {row['tokens_per_s']:9.0f} {row['mfu']:6.3f} "
          f"{ratio:>18} {row['first_loss']:11.4f}")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  gin_files, bindings, search_paths, other = gin_utils.parse_flags(argv)
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      epilog="gin: --gin_file=F (default runs/quickstart.gin), --gin.NAME=VALUE, "
      "--gin_search_paths=DIRS, as openmoe-train.")
  parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                      help="NAME:BINDING[;BINDING...], timed against the baseline")
  parser.add_argument("--rounds", type=int, default=8, help="timed pairs per variant")
  parser.add_argument("--warmup", type=int, default=1, help="untimed pairs per variant")
  parser.add_argument("--batch_size", type=int, default=None,
                      help="default: gin's train.batch_size")
  parser.add_argument("--sequence_length", type=int, default=None,
                      help="default: gin's train.sequence_length")
  parser.add_argument("--vocab_size", type=int, default=None,
                      help="default: ModelConfig.vocab_size, else the task's vocabulary")
  parser.add_argument("--data", action="store_true",
                      help=f"add the path {DATA!r}: the baseline's step fed by the run's "
                      "input pipeline, to time what the pipeline costs the step")
  parser.add_argument("--json", action="store_true", help="one JSON object per row")
  args = parser.parse_args(other)
  names = [BASE] + ([DATA] if args.data else []) + [name for name, _ in args.variant]
  if len(set(names)) != len(names):
    parser.error(f"--variant: names must differ from each other and from {BASE!r}"
                 f"{f' and {DATA!r}' if args.data else ''}: {names}")
  if args.rounds < 1 or args.warmup < 0:
    parser.error("--rounds must be >= 1 and --warmup >= 0")
  try:
    rows = run(gin_files or [DEFAULT_GIN_FILE], bindings, search_paths, args.variant,
               args.rounds, args.warmup, args.batch_size, args.sequence_length,
               args.vocab_size, args.data)
  except (gin_utils.GinConfigError, RunConfigError) as e:
    parser.error(str(e))
  if args.json:
    for row in rows:
      print(json.dumps(row), flush=True)
  else:
    _print_table(rows)


if __name__ == "__main__":
  main()
