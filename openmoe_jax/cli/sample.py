"""`openmoe-sample --model_dir=DIR --prompt="def f("`: sample from a trained run.

Autoregressive decoding (decoding/autoregressive.py: greedy, temperature, top-p,
KV cache) for causal LM / UL2 runs, iterative unmasking (decoding/diffusion.py) for
masked-diffusion runs; `--mode=auto` picks by the run's objective. Routing: see
`decoding.serving.serving_config`.
"""
import sys

import jax

from openmoe_jax import objectives
from openmoe_jax.cli import flags
from openmoe_jax.decoding.autoregressive import sample_autoregressive
from openmoe_jax.decoding.diffusion import sample_diffusion
from openmoe_jax.decoding.serving import serving_config
from openmoe_jax.model import Decoder

PROGRAM = flags.Program(
    "openmoe-sample",
    "Print the continuation of --prompt sampled from a trained run (a training "
    "MODEL_DIR or a params export): autoregressive decoding with a KV cache (greedy, "
    "temperature, top-p) for causal LM and UL2 runs, iterative unmasking for "
    "masked-diffusion runs (--mode=auto picks by the run's objective).",
    ["openmoe-sample --model_dir=/tmp/openmoe_quickstart --prompt='def main('",
     "openmoe-sample --model_dir=/tmp/run --prompt='The ' --temperature=0.8 "
     "--top_p=0.9 --max_new_tokens=128"])
PROGRAM.add("--model_dir", required=True, help="training MODEL_DIR or params export")
PROGRAM.add("--prompt", default="")
PROGRAM.add("--mode", choices=["auto", "ar", "diffusion"], default="auto")
PROGRAM.add("--step", type=flags.int_at_least(0), help="checkpoint step (default: latest)")
PROGRAM.add("--max_new_tokens", type=flags.int_at_least(1), default=64)
PROGRAM.add("--temperature", type=flags.float_in(0.0), default=0.0, help="0: greedy")
PROGRAM.add("--top_p", type=flags.float_in(0.0, 1.0, low_open=True), default=1.0)
PROGRAM.add("--steps", type=flags.int_at_least(1), default=32, help="diffusion: denoising steps")
PROGRAM.add("--block_length", type=flags.int_at_least(1), help="diffusion: semi-AR block length")
PROGRAM.add("--remasking", choices=["low_confidence", "random"],
            default="low_confidence")
PROGRAM.add("--seed", type=int, default=0)


def _run(args, gin_flags) -> int:
  del gin_flags
  from openmoe_jax import run_loader  # pylint: disable=g-import-not-at-top
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  run = run_loader.load_run(args.model_dir)
  params = run_loader.restore_params(args.model_dir, run_loader.pick_step(run, args.step))
  vocab = pipeline.vocabulary_for(run.mixture_or_task_name)
  objective = run_loader.query("train.objective")
  diffusion = args.mode == "diffusion" or (
      args.mode == "auto" and objectives.is_diffusion(objective))
  model = Decoder(serving_config(run.config, diffusion))
  prompt_ids = vocab.encode(args.prompt)
  rng = jax.random.PRNGKey(args.seed)
  if diffusion:  # the diffusion objective reads targets: no start token
    prompt_ids = prompt_ids or [0]
    out = sample_diffusion(model, params, prompt_ids, gen_length=args.max_new_tokens,
                           steps=args.steps, block_length=args.block_length,
                           remasking=args.remasking, temperature=args.temperature,
                           rng=rng, mask_id=run_loader.run_mask_id(objective, vocab),
                           vocab_limit=vocab.vocab_size)[0]
  else:
    # Training inputs are targets shifted right behind a 0 (seqio's decoder feature
    # converter; OpenMoE's umT5 BOS): every sequence starts with 0.
    prompt_ids = [0] + prompt_ids
    out = sample_autoregressive(model, params, prompt_ids, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p, rng=rng,
                                eos_id=vocab.eos_id, vocab_limit=vocab.vocab_size)
  new_ids = [int(i) for i in out[len(prompt_ids):]]
  if vocab.eos_id in new_ids:
    new_ids = new_ids[:new_ids.index(vocab.eos_id)]
  print(args.prompt + vocab.decode(new_ids))
  return 0


def main(argv=None) -> int:
  """CLI: prints the continuation of --prompt sampled from --model_dir; returns the
  exit code (0, or 2 on bad input)."""
  return PROGRAM.main(_run, argv)


if __name__ == "__main__":
  sys.exit(main())
