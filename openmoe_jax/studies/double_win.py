"""OpenMoE 2's "diffusion + MoE is a double win" at small scale, and the
data-repetition crossover, in one command (`openmoe-ablate --study=double_win`).

Four arms train on the same data with the same seed, batch and steps (so the same
tokens seen): autoregressive (AR, causal LM) and masked diffusion (DLM), each with a
dense model and an MoE model of the same activated parameters per token (asserted
with the parameter counter; the MoE router's d x E weights are the one difference,
stated). The data is a fixed subset of M unique training tokens of the embedded
corpus, repeated for as many epochs as the steps need; validation is on held-out
documents (studies/double_win_data.py).

Every arm keeps a checkpoint at `eval_points` evenly spaced steps; each is scored on
the same held-out tokens in nats per token (evaluate.heldout_nll): the exact NLL
for AR, the negative ELBO (an upper bound on the NLL) with its Monte Carlo standard
error for DLM. The MoE arms' checkpoints also feed the routing analysis of
`openmoe-analyze` (analysis/study.py): the top-expert overlap of each early
checkpoint with the final one ("routing is learned early"). The report
(studies/double_win_report.py) writes the table, the plot and the JSON.

Rerunning with the same output folder resumes: finished arms and evaluations are
reused, an interrupted arm resumes from its last checkpoint.
"""
import dataclasses
import json
import os
import time
from typing import Any, Callable, Dict, List, Sequence

import gin
import jax

from openmoe_jax import errors, gin_utils, param_count, run_loader
from openmoe_jax.analysis.study import analyze_records, record_checkpoints
from openmoe_jax.config import ModelConfig, build_model_config
from openmoe_jax.data import pipeline
from openmoe_jax.data import vocabulary as vocab_lib
from openmoe_jax.evaluate import heldout_nll
from openmoe_jax.model import Decoder
from openmoe_jax.studies import double_win_data as data_lib
from openmoe_jax.trainer import train

OBJECTIVE_GIN = {"ar": "objectives/causal_lm.gin",
                 "dlm": "objectives/masked_diffusion.gin"}
ROUTING_TASKS = ("local_code", "local_text")


@dataclasses.dataclass(frozen=True)
class Arm:
  """One of the four runs: objective "ar" or "dlm", model "dense" or "moe"."""

  objective: str
  model: str

  @property
  def name(self) -> str:
    return f"{self.objective}_{self.model}"


ARMS = (Arm("ar", "dense"), Arm("dlm", "dense"), Arm("ar", "moe"), Arm("dlm", "moe"))


@dataclasses.dataclass(frozen=True)
class StudySettings:
  """What the study trains on and how long (defaults: about an hour on 2 cores)."""

  steps: int = 1000
  unique_tokens: int = 50_000
  validation_tokens: int = 16_384
  eval_points: int = 10
  dlm_samples: int = 4  # mask draws per validation batch for the DLM bound
  run_gin: str = "runs/double_win.gin"
  dense_gin: str = "experiments/openmoe2/dense.gin"
  moe_gin: str = "experiments/openmoe2/tc_softmax.gin"
  bindings: Sequence[str] = ()
  routing_batches: int = 4  # batches per routing task and checkpoint
  seed: int = 0

  def model_gin(self, arm: Arm) -> str:
    return self.dense_gin if arm.model == "dense" else self.moe_gin

  def checkpoint_every(self) -> int:
    return max(1, self.steps // self.eval_points)


def _configure(settings: StudySettings, arm: Arm, extra: Sequence[str]) -> None:
  """Parses the arm's gin files (cleared first) with `extra` then the user's
  bindings."""
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(
      [settings.run_gin, settings.model_gin(arm), OBJECTIVE_GIN[arm.objective]],
      [*extra, *settings.bindings], finalize=False)


def _model_config() -> ModelConfig:
  """Returns the parsed gin's model config with the vocabulary size filled in."""
  return build_model_config(run_loader.query("train.model_config"), _vocab_size())


def _vocab_size() -> int:
  return vocab_lib.get_vocabulary().vocab_size


def parameter_counts(settings: StudySettings) -> Dict[str, Dict[str, int]]:
  """Returns count_params of the dense and the MoE model (plus their router
  weights); errors.InputError when their activated parameters differ by more
  than the router."""
  counts = {}
  for model in ("dense", "moe"):
    _configure(settings, Arm("ar", model), [])
    counts[model] = param_count.count_params(_model_config())
  dense, moe = counts["dense"], counts["moe"]
  if moe["experts"] == 0:
    raise errors.InputError(f"the MoE model ({settings.moe_gin}) has no routed "
                            "experts")
  if moe["activated"] - moe["router"] != dense["activated"] - dense["router"]:
    raise errors.InputError(
        f"the arms must have the same activated parameters per token: dense "
        f"({settings.dense_gin}) {dense['activated']:,}, MoE ({settings.moe_gin}) "
        f"{moe['activated']:,} of which {moe['router']:,} router weights; pick an MoE "
        "whose top_k x expert_d_ff equals the dense d_ff")
  return counts


def prepare_data(settings: StudySettings, output: str, say: Callable[[str], None]
                 ) -> data_lib.StudyData:
  """Writes (or reuses) the study's data under output/data; returns it with its
  token counts measured from one pass of the pipeline."""
  _configure(settings, ARMS[0], [])
  folder = os.path.join(output, "data")
  meta_path = os.path.join(folder, "meta.json")
  wanted = {"unique_tokens": settings.unique_tokens,
            "validation_tokens": settings.validation_tokens, "seed": settings.seed,
            "vocab_size": _vocab_size()}
  if os.path.exists(meta_path):
    with open(meta_path) as f:
      meta = json.load(f)
    if meta["wanted"] != wanted:
      raise errors.InputError(
          f"{output} holds a study made with {meta['wanted']}, not {wanted}: pick "
          "another --output or the same settings")
    return data_lib.StudyData(**meta["data"])
  say(f"data: {settings.unique_tokens:,} unique training tokens and "
      f"{settings.validation_tokens:,} held-out tokens from the embedded corpus")
  data = data_lib.write_study_data(folder, vocab_lib.get_vocabulary(),
                                   settings.unique_tokens, settings.validation_tokens,
                                   settings.seed)
  _configure(settings, ARMS[0], data_lib.gin_bindings(data))
  length, batch = run_loader.query("train.sequence_length"), run_loader.query("train.batch_size")
  train_pass = data_lib.count_tokens(data_lib.one_pass("train", length, batch))
  val_pass = data_lib.count_tokens(data_lib.one_pass("validation", length, batch))
  data = dataclasses.replace(data, train_tokens=train_pass["tokens"],
                             train_rows=train_pass["rows"],
                             validation_tokens=val_pass["tokens"])
  with open(meta_path, "w") as f:
    json.dump({"wanted": wanted, "data": dataclasses.asdict(data)}, f, indent=1)
  return data


def _arm_bindings(settings: StudySettings, data: data_lib.StudyData,
                  model_dir: str) -> List[str]:
  return [f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {settings.steps}",
          f"train.checkpoint_every_steps = {settings.checkpoint_every()}",
          f"train.keep_checkpoints = {settings.eval_points + 2}",
          f"train.seed = {settings.seed}", *data_lib.gin_bindings(data)]


def train_arm(settings: StudySettings, data: data_lib.StudyData, arm: Arm,
              output: str, say: Callable[[str], None]) -> Dict[str, Any]:
  """Trains `arm` in output/<arm> (resuming what is there); returns its training
  summary (seconds, tokens/s, final step, last train metrics), kept in
  output/<arm>/study_train.json for a rerun that finds the arm finished."""
  model_dir = os.path.join(output, arm.name)
  saved = os.path.join(model_dir, "study_train.json")
  if os.path.exists(saved):
    with open(saved) as f:
      trained = json.load(f)
    if trained["final_step"] == settings.steps:
      return trained
  _configure(settings, arm, _arm_bindings(settings, data, model_dir))
  gin_utils.check_required(train)
  start = time.perf_counter()
  summary = train(print_fn=lambda line: say(f"[{arm.name}] {line}"))
  trained = {"seconds": time.perf_counter() - start,
             "tokens_per_sec": summary.get("tokens_per_sec"),
             "final_step": summary["final_step"],
             "last_train_metrics": {k: float(v) for k, v in
                                    summary.get("last_train_metrics", {}).items()}}
  with open(saved, "w") as f:
    json.dump(trained, f, indent=1)
  return trained


def validation_batches(settings: StudySettings, data: data_lib.StudyData
                       ) -> List[Dict]:
  """Returns the held-out batches every arm is scored on (one ordered pass)."""
  _configure(settings, ARMS[0], data_lib.gin_bindings(data))
  return data_lib.one_pass("validation", run_loader.query("train.sequence_length"),
                           run_loader.query("train.batch_size"))


def evaluate_arm(settings: StudySettings, arm: Arm, output: str, batches: List[Dict],
                 say: Callable[[str], None]) -> List[Dict[str, Any]]:
  """Scores every checkpoint of `arm` on `batches`; returns one dict per step
  (step, nll, stderr, bound), cached in output/<arm>/heldout_nll.json."""
  model_dir = os.path.join(output, arm.name)
  cache = os.path.join(model_dir, "heldout_nll.json")
  run = run_loader.load_run(model_dir)
  if os.path.exists(cache):
    with open(cache) as f:
      rows = json.load(f)
    if [r["step"] for r in rows] == run.steps:
      return rows
  objective = run_loader.query("train.objective")
  model = Decoder(run.config)
  rows = []
  for step in run.steps:
    start = time.perf_counter()
    params = run_loader.restore_params(model_dir, step)
    result = heldout_nll(model, params, batches, objective,
                         num_samples=settings.dlm_samples, seed=settings.seed)
    rows.append({"step": step, **result})
    spread = f" ± {result['stderr']:.4f}" if result["bound"] else ""
    say(f"[{arm.name}] step {step}: held-out NLL {result['nll']:.4f}{spread} nats/token "
        f"({time.perf_counter() - start:.1f}s)")
  with open(cache, "w") as f:
    json.dump(rows, f, indent=1)
  return rows


def routing_overlap(settings: StudySettings, arm: Arm, output: str,
                    say: Callable[[str], None]) -> Dict[str, Any]:
  """Runs openmoe-analyze's recording and analyses over every checkpoint of the MoE
  arm `arm` (report in output/<arm>/routing); returns its early-routing result
  (steps, mean top-expert overlap with the final checkpoint)."""
  model_dir = os.path.join(output, arm.name)
  folder = os.path.join(model_dir, "routing")
  report = os.path.join(folder, "report.json")
  if not os.path.exists(report):
    run = run_loader.load_run(model_dir, vocab_task=ROUTING_TASKS[0])
    records, meta = record_checkpoints(run, run.steps, ROUTING_TASKS, folder,
                                       num_batches=settings.routing_batches,
                                       say=lambda m: say(f"[{arm.name}] {m}"))
    vocab = pipeline.vocabulary_for(ROUTING_TASKS[0])
    analyze_records(records, folder, meta, decode=lambda i: vocab.decode([i]),
                    say=lambda m: say(f"[{arm.name}] {m}"))
  with open(report) as f:
    stability = json.load(f)["stability"]
  return {"steps": stability["steps"], "mean_to_final": stability["mean_to_final"],
          "report": os.path.join(folder, "report.md")}


def run_study(settings: StudySettings, output: str,
              say: Callable[[str], None] = print) -> Dict[str, Any]:
  """Runs the whole study into `output`; returns the results dict the report
  is made of (also written as output/double_win.json)."""
  started = time.perf_counter()
  counts = parameter_counts(settings)
  say(f"activated parameters per token: dense {counts['dense']['activated']:,}, MoE "
      f"{counts['moe']['activated']:,} ({counts['moe']['router']:,} of them router "
      f"weights); total: dense {counts['dense']['total']:,}, MoE "
      f"{counts['moe']['total']:,}")
  data = prepare_data(settings, output, say)
  _configure(settings, ARMS[0], [])
  batch, length = run_loader.query("train.batch_size"), run_loader.query("train.sequence_length")
  epochs_per_step = batch / max(data.train_rows, 1)
  say(f"data: {data.train_tokens:,} unique training tokens in {data.train_documents} "
      f"documents ({data.train_rows} rows of {length}); {data.validation_tokens:,} "
      f"held-out tokens; {settings.steps} steps x {batch} rows = "
      f"{settings.steps * epochs_per_step:.1f} epochs")
  batches = validation_batches(settings, data)
  results: Dict[str, Any] = {
      "settings": {**dataclasses.asdict(settings), "bindings": list(settings.bindings),
                   "batch_size": batch, "sequence_length": length},
      "data": dataclasses.asdict(data), "parameters": counts, "arms": {},
      "backend": jax.default_backend()}
  for i, arm in enumerate(ARMS):
    say(f"=== arm {i + 1}/{len(ARMS)}: {arm.name} ({settings.steps} steps) ===")
    trained = train_arm(settings, data, arm, output, say)
    curve = evaluate_arm(settings, arm, output, batches, say)
    for row in curve:
      row["epochs"] = row["step"] * epochs_per_step
    results["arms"][arm.name] = {"objective": arm.objective, "model": arm.model,
                                 "curve": curve, **trained}
    if arm.model == "moe":
      results["arms"][arm.name]["routing"] = routing_overlap(settings, arm, output, say)
  results["seconds"] = time.perf_counter() - started
  return results
