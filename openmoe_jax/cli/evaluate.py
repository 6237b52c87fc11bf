"""Evaluation of a trained run: `openmoe-eval --model_dir=DIR [--task=NAME]`.

Causal LM and UL2 runs: token-weighted cross-entropy on the targets (UL2: targets
only) and its perplexity, with the run's own objective at the evaluation capacity.
Masked-diffusion runs: the perplexity upper bound from the ELBO (evaluate.py),
estimated with `--num_samples` Monte Carlo draws per batch (fixed seeds) and its
standard error.
"""
import json
import math
import sys

import jax

from openmoe_jax import objectives
from openmoe_jax.cli import flags
from openmoe_jax.evaluate import evaluate_diffusion
from openmoe_jax.model import Decoder
from openmoe_jax.objectives import CausalLm

PROGRAM = flags.Program(
    "openmoe-eval",
    "Evaluate a trained run (a training MODEL_DIR or a params export) on a split of "
    "its task and print one JSON object: cross-entropy and perplexity for causal LM "
    "and UL2 runs, the ELBO perplexity bound (with its standard error) for "
    "masked-diffusion runs.",
    ["openmoe-eval --model_dir=/tmp/openmoe_quickstart",
     "openmoe-eval --model_dir=/tmp/openmoe_quickstart --task=local_code "
     "--num_batches=16"])
PROGRAM.add("--model_dir", required=True, help="training MODEL_DIR or params export")
PROGRAM.add("--task", help="mixture or task (default: the run's own)")
PROGRAM.add("--split", default="validation")
PROGRAM.add("--num_batches", type=flags.int_at_least(1), default=8)
PROGRAM.add("--num_samples", type=flags.int_at_least(1), default=16, help="diffusion: ELBO draws")
PROGRAM.add("--step", type=flags.int_at_least(0), help="checkpoint step (default: latest)")
PROGRAM.add("--seed", type=int, default=0)


def _run(args, gin_flags) -> int:
  del gin_flags
  from openmoe_jax import run_loader, trainer  # pylint: disable=g-import-not-at-top
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  run = run_loader.load_run(args.model_dir)
  step = run_loader.pick_step(run, args.step)
  objective = run_loader.query("train.objective") or CausalLm()
  task = args.task or run.mixture_or_task_name
  if args.task:
    run_loader.check_task(args.task, "--task")
  run_loader.check_split(task, args.split)
  params = run_loader.restore_params(args.model_dir, step)
  batches = pipeline.get_dataset(task, run.sequence_length, run.batch_size,
                                 split=args.split, shuffle=False, repeat=False,
                                 num_batches=args.num_batches)
  model = Decoder(run.config)
  if objectives.is_diffusion(objective):
    mask_id = run_loader.run_mask_id(objective, pipeline.vocabulary_for(task))
    result = evaluate_diffusion(model, params, batches, objective, mask_id,
                                args.num_samples, args.seed)
  else:
    eval_step = jax.jit(trainer.make_eval_step(model, objective))
    result = trainer.evaluate(eval_step, params, batches, lambda b: b)
    result["perplexity"] = math.exp(result["ce_loss"])
  result.update(step=step, task=task, objective=type(objective).__name__)
  print(json.dumps(result, sort_keys=True))
  return 0


def main(argv=None) -> int:
  """CLI: prints one JSON object with the run's validation metrics; returns the exit
  code (0, or 2 on bad input)."""
  return PROGRAM.main(_run, argv)


if __name__ == "__main__":
  sys.exit(main())
