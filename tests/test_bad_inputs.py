"""Bad inputs on every command (issue 14, item 8).

Each row gives a program a wrong input: an unknown flag or gin binding, a value of
the wrong type, an out-of-range value, a mesh, batch or group size that does not
divide, a MODEL_DIR with no checkpoint, an unknown topology, task or split, a missing
path. Every one must end with exit code 2 and ONE line on stderr,
`<prog>: error: ...`, naming the culprit, no traceback, and nothing changed under
the real MODEL_DIR the rows point at (trained once per module, 2 steps).

The checks run in-process through each program's `main(argv)` and must fire before
anything is compiled (the whole file runs in well under two minutes on 2 cores);
one subprocess row shows that `python -m openmoe_jax.cli.train` prints no traceback
either (gin, absl and the native logs included).
"""
import os
import shutil
import subprocess
import sys

import gin
import pytest
from run_files import tree_digest

from openmoe_jax.cli import (ablate, analyze, convert, evaluate, params, plan, sample,
                             train, upcycle)

TINY_BINDINGS = [
    "ModelConfig.d_model=32", "ModelConfig.num_heads=2", "ModelConfig.head_dim=16",
    "ModelConfig.d_ff=64", "ModelConfig.num_layers=2", "MoeConfig.num_experts=4",
    "MoeConfig.group_size=64", "SEQUENCE_LENGTH=64", "BATCH_SIZE=8",
    "train.eval_batches=1", "train.log_every_steps=1", "train.eval_every_steps=1000",
    "adamw_warmup_cosine.warmup_steps=1",
]
PROGRAMS = {"openmoe-train": train, "openmoe-eval": evaluate, "openmoe-sample": sample,
            "openmoe-plan": plan, "openmoe-analyze": analyze, "openmoe-ablate": ablate,
            "openmoe-upcycle": upcycle, "openmoe-params": params,
            "openmoe-convert": convert}
MODEL = ["--gin_file=models/quickstart_moe.gin", "--gin.ModelConfig.vocab_size=8192"]
UPCYCLE_GIN = ["--gin_file=runs/ablate_tiny.gin",
               "--gin_file=experiments/openmoe2/upcycled.gin"]


def _train_args(model_dir, steps=4, tiny=True):
  tiny_flags = [f"--gin.{b}" for b in TINY_BINDINGS] if tiny else []
  return ["--gin_file=runs/quickstart.gin", *tiny_flags,
          f"--gin.MODEL_DIR={model_dir}", f"--gin.TRAIN_STEPS={steps}"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """Returns {"md": a real MODEL_DIR with a step-2 checkpoint, "nockpt": a folder
  with its config.gin and no checkpoint, "tmp": a scratch folder}."""
  root = tmp_path_factory.mktemp("bad_inputs")
  model_dir = str(root / "run")
  gin.clear_config()
  assert train.main(_train_args(model_dir, steps=2)
                    + ["--gin.train.checkpoint_every_steps=2"]) == 0
  gin.clear_config()
  no_checkpoint = root / "nockpt"
  no_checkpoint.mkdir()
  shutil.copy(os.path.join(model_dir, "config.gin"), no_checkpoint / "config.gin")
  return {"md": model_dir, "nockpt": str(no_checkpoint), "tmp": str(root / "scratch")}


# (program, argv with {md}/{nockpt}/{tmp} placeholders, text the line must contain)
CASES = [
    # openmoe-train: MODEL_DIR is the real run, which must stay untouched.
    ("openmoe-train", ["@train", "--bogus"], "--bogus"),
    ("openmoe-train", ["@train", "--gin.TRAIN_STEP=5"], "did you mean TRAIN_STEPS"),
    ("openmoe-train", ["@train", "--gin.ModelConfig.d_modl=5"], "d_modl"),
    ("openmoe-train", ["@train", "--gin.ModelConfig.d_model='big'"],
     "ModelConfig.d_model='big' must be an int"),
    ("openmoe-train", ["@train", "--gin.MoeConfig.top_k=8"], "top_k (8) <= num_experts (4)"),
    ("openmoe-train", ["@train", "--gin.MoeConfig.capacity_factor_train=0"],
     "capacity_factor_train=0 must be > 0"),
    ("openmoe-train", ["@train", "--gin.MoeConfig.group_size=100"],
     "MoeConfig.group_size=100 must divide the 512 tokens"),
    ("openmoe-train", ["@train", "--gin.make_mesh.data=3"], "product is 8"),
    ("openmoe-train", ["@train", "--gin.train.microbatches=3"], "microbatches (3)"),
    ("openmoe-train", ["@train", "--gin.MIXTURE_OR_TASK_NAME=local_mixx"],
     "did you mean 'local_mix'"),
    ("openmoe-train", ["@train_full", "--gin.adamw_warmup_cosine.warmup_steps=10"],
     "total_steps (4; the run files bind it to TRAIN_STEPS) must exceed "
     "adamw_warmup_cosine.warmup_steps (10)"),
    ("openmoe-train", ["--gin_file=runs/quickstrat.gin"], "'runs/quickstrat.gin' not found"),
    ("openmoe-train", ["--gin_file"], "--gin_file needs a value"),
    # openmoe-eval
    ("openmoe-eval", ["--model_dir={nockpt}"], "no checkpoint in"),
    ("openmoe-eval", ["--model_dir={tmp}/missing"], "config.gin not found"),
    ("openmoe-eval", ["--model_dir={md}", "--task=local_cod"], "did you mean 'local_code'"),
    ("openmoe-eval", ["--model_dir={md}", "--step=7"], "--step=7"),
    ("openmoe-eval", ["--model_dir={md}", "--num_batches=0"], "--num_batches"),
    ("openmoe-eval", ["--model_dir={md}", "--num_batches=many"], "--num_batches"),
    ("openmoe-eval", ["--model_dir={md}", "--split=test"], "valid: train, validation"),
    ("openmoe-eval", ["--model_dir={md}", "--gin.TRAIN_STEPS=3"], "takes no gin flags"),
    # openmoe-sample
    ("openmoe-sample", ["--model_dir={nockpt}"], "no checkpoint in"),
    ("openmoe-sample", ["--model_dir={md}", "--step=7"], "available steps: [2]"),
    ("openmoe-sample", ["--model_dir={md}", "--top_p=1.5"], "--top_p"),
    ("openmoe-sample", ["--model_dir={md}", "--temperature=-1"], "--temperature"),
    ("openmoe-sample", ["--model_dir={md}", "--max_new_tokens=0"], "--max_new_tokens"),
    ("openmoe-sample", ["--model_dir={md}", "--mode=beam"], "--mode"),
    # openmoe-plan (libtpu's topology descriptions; nothing is compiled)
    ("openmoe-plan", [*MODEL, "--topology=v9:2x2"], "--topology='v9:2x2'"),
    ("openmoe-plan", [*MODEL, "--topology=v5e"], "GENERATION:AxB"),
    ("openmoe-plan", [*MODEL, "--topology=v5e:2x2", "--gin.BATCH_SIZ=8"],
     "did you mean BATCH_SIZE"),
    ("openmoe-plan", [*MODEL, "--topology=v5e:2x2", "--gin.BATCH_SIZE=6"],
     "BATCH_SIZE=6 must be divisible"),
    ("openmoe-plan", [*MODEL, "--topology=v5e:2x2", "--gin.make_mesh.data=3"],
     "product is 4"),
    ("openmoe-plan", [*MODEL, "--topology=v5e:2x2", "--gin.MoeConfig.top_k=99"], "top_k (99)"),
    ("openmoe-plan", [*MODEL, "--topology=v5e:2x2", "--step_time=-1"], "--step_time"),
    ("openmoe-plan", [*MODEL, "--topology=v5e:2x2", "--gin.BATCH_SIZE=0"],
     "BATCH_SIZE=0 must be an integer >= 1"),
    ("openmoe-plan", [*MODEL, "--topology=v5e:2x2", "--gin.plan.microbatches=0"],
     "plan.microbatches=0 must be an integer >= 1"),
    ("openmoe-plan", ["--topology=v5e:2x2"], "--gin_file is required"),
    # openmoe-analyze
    ("openmoe-analyze", ["--model_dir={nockpt}", "--output={tmp}/a"], "no checkpoint in"),
    ("openmoe-analyze", ["--model_dir={md}", "--output={tmp}/a", "--tasks=local_txt"],
     "did you mean 'local_text'"),
    ("openmoe-analyze", ["--model_dir={md}", "--output={tmp}/a", "--checkpoints=7"],
     "available: [2]"),
    ("openmoe-analyze", ["--model_dir={md}", "--output={tmp}/a", "--checkpoints=last"],
     "--checkpoints='last'"),
    ("openmoe-analyze", ["--model_dir={md}", "--output={tmp}/a", "--num_batches=0"],
     "--num_batches"),
    ("openmoe-analyze", ["--model_dir={md}", "--output={tmp}/a", "--pack=maybe"], "--pack"),
    ("openmoe-analyze", ["--model_dir={md}"], "--output"),
    ("openmoe-analyze", ["--output={tmp}/a"], "give --model_dir (or --from_records)"),
    ("openmoe-analyze", ["--model_dir={md}", "--output={tmp}/a", "--tasks=,"],
     "--tasks is empty: name at least one seqio task"),
    # openmoe-ablate
    ("openmoe-ablate", ["--arms=tc_sofmax", "--output={tmp}/abl"], "unknown arms"),
    ("openmoe-ablate", ["--steps=1", "--output={tmp}/abl"], "--steps=1"),
    ("openmoe-ablate", ["--steps=ten"], "--steps"),
    ("openmoe-ablate", ["--steps=0", "--output={tmp}/abl"], "--steps"),  # not the default
    ("openmoe-ablate", ["--run_gin=runs/nope.gin", "--output={tmp}/abl"], "nope.gin"),
    ("openmoe-ablate", ["--gin_file=runs/quickstart.gin"], "--gin_file"),
    ("openmoe-ablate", ["--arms=dense", "--steps=2", "--output={tmp}/abl",
                        "--gin.TRAIN_STEP=3"], "did you mean TRAIN_STEPS"),
    # openmoe-upcycle
    ("openmoe-upcycle", ["--dense_checkpoint={nockpt}", "--output={tmp}/up", *UPCYCLE_GIN],
     "no checkpoint in"),
    ("openmoe-upcycle", ["--dense_checkpoint={md}", "--output={md}", *UPCYCLE_GIN],
     "pick a new --output"),
    ("openmoe-upcycle", ["--dense_checkpoint={md}", "--output={tmp}/up", "--step=7",
                         *UPCYCLE_GIN], "step 7"),
    ("openmoe-upcycle", ["--dense_checkpoint={md}", "--output={tmp}/up"], "--gin_file"),
    ("openmoe-upcycle", ["--dense_checkpoint={md}", "--output={tmp}/up", *UPCYCLE_GIN,
                         "--gin.TRAIN_STEP=3"], "did you mean TRAIN_STEPS"),
    ("openmoe-upcycle", ["--dense_checkpoint={md}", "--output={tmp}/up", "--seed=x",
                         *UPCYCLE_GIN], "--seed"),
    ("openmoe-upcycle", ["--dense_checkpoint={md}", "--output={tmp}/up", "--step=-1",
                         *UPCYCLE_GIN], "--step"),
    # openmoe-params
    ("openmoe-params", ["--gin_file=models/quickstart_moe.gin"], "vocab_size"),
    ("openmoe-params", [*MODEL, "--gin.MoeConfig.top_k=99"], "top_k (99)"),
    ("openmoe-params", [*MODEL, "--gin.ModelConfig.vocab_size=-5"], "vocab_size=-5"),
    ("openmoe-params", [*MODEL, "--gin.ModelConfig.num_layers='x'"], "num_layers='x'"),
    ("openmoe-params", [*MODEL, "--gin.MoeConfig.num_expert=3"], "num_expert"),
    ("openmoe-params", [*MODEL, "--gin.VOCAB=3"], "VOCAB"),
    ("openmoe-params", [*MODEL, "--json"], "--json"),
    # openmoe-convert
    ("openmoe-convert", ["params", "--model_dir={nockpt}", "--output={tmp}/c"],
     "no checkpoint in"),
    ("openmoe-convert", ["params", "--model_dir={md}", "--output={md}"], "--output"),
    ("openmoe-convert", ["params", "--model_dir={md}", "--output={tmp}/c", "--step=7"],
     "--step=7"),
    ("openmoe-convert", ["params", "--model_dir={md}", "--output={tmp}/c", "--dtype=int8"],
     "--dtype"),
    ("openmoe-convert", ["to-hf", "--model_dir={md}", "--output={tmp}/c", "--layout=gpt"],
     "--layout"),
    ("openmoe-convert", ["to-hf", "--model_dir={md}", "--output={tmp}/c",
                         "--layout=openmoe", "--max_shard_gb=0"], "--max_shard_gb"),
    ("openmoe-convert", ["from-t5x", "--checkpoint={tmp}/missing", "--output={tmp}/c",
                         *MODEL], "missing: no such directory"),
    ("openmoe-convert", ["frob", "--model_dir={md}"], "'frob'"),
    ("openmoe-convert", ["from-t5x", "--checkpoint={md}", "--output={tmp}/c", "--step=-1",
                         *MODEL], "--step"),
]


def _argv(template, dirs):
  argv = []
  for arg in template:
    if arg == "@train":
      argv += _train_args(dirs["md"])
    elif arg == "@train_full":  # the run file's own schedule, no tiny total_steps
      argv += _train_args(dirs["md"], steps=4, tiny=False)[:1] + [
          f"--gin.{b}" for b in TINY_BINDINGS if "warmup" not in b] + [
              f"--gin.MODEL_DIR={dirs['md']}", "--gin.TRAIN_STEPS=4"]
    else:
      argv.append(arg.format(**dirs))
  return argv


@pytest.mark.parametrize(
    "prog,template,culprit", CASES,
    ids=[f"{c[0][len('openmoe-'):]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(prog, template, culprit, dirs,
                                                          capsys):
  before = {name: tree_digest(dirs[name]) for name in ("md", "nockpt")}
  capsys.readouterr()
  code = PROGRAMS[prog].main(_argv(template, dirs))
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2, err
  assert len(lines) == 1, err
  assert lines[0].startswith(f"{prog}: error: "), err
  assert culprit in lines[0], err
  assert "Traceback" not in err
  assert {name: tree_digest(dirs[name]) for name in ("md", "nockpt")} == before


def test_every_program_has_at_least_five_bad_inputs():
  counts = {prog: sum(c[0] == prog for c in CASES) for prog in PROGRAMS}
  assert min(counts.values()) >= 5, counts


def test_command_line_has_no_traceback_from_gin_absl_or_native_logs(dirs):
  """As a real process, a value that a gin-called configurable rejects (gin adds
  its "In call to configurable" lines) leaves exactly one stderr line."""
  env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  before = tree_digest(dirs["md"])
  proc = subprocess.run(
      [sys.executable, "-m", "openmoe_jax.cli.train", *_train_args(dirs["md"]),
       "--gin.MoeConfig.capacity_factor_eval=0"],
      capture_output=True, text=True, env=env, timeout=300, check=False)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr
  assert len(lines) == 1 and lines[0].startswith("openmoe-train: error: "), proc.stderr
  assert "capacity_factor_eval=0 must be > 0" in lines[0]
  assert tree_digest(dirs["md"]) == before
