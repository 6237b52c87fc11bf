"""Sparse upcycling: turn a trained dense checkpoint into an MoE checkpoint (the
command line is cli/upcycle.py).

  openmoe-upcycle --dense_checkpoint=/tmp/dense --output=/tmp/moe \\
      --gin_file=runs/ablate_tiny.gin --gin_file=experiments/openmoe2/upcycled.gin

The gin files describe the MoE run (model, optimizer, task) exactly as `openmoe-train`
would be given them. Attention, norms, embeddings and the head are copied; each dense
FFN becomes the experts of the MoE layer at the same depth: copied whole into every
expert when the expert hidden size equals the dense one, or, for fine-grained experts,
split along the hidden dimension into n = d_ff / expert_d_ff slices, expert e holding
slice e mod n (n must divide E). Selecting one expert of each slice with weight 1
computes the dense FFN exactly (each hidden unit's contribution is separate in a gated
MLP). Routers are freshly initialised; the optimizer state is fresh. The output is a
MODEL_DIR with a step-0 checkpoint: train with the same gin files and
`--gin.MODEL_DIR=<output>` to continue from it.
"""
import json
import os
from typing import Any, Dict, List

import jax
import numpy as np

from openmoe_jax import gin_utils, partitioning
from openmoe_jax.checkpoints import Checkpointer
from openmoe_jax.config import ModelConfig, build_model_config
from openmoe_jax.data import pipeline
from openmoe_jax.layers.mlp import wi_0_width
from openmoe_jax.model import Decoder, get_layer, layer_slots, set_layer
from openmoe_jax.run_loader import load_run, query, restore_params
from openmoe_jax.trainer import TrainState, init_train_state

def split_ffn_into_experts(mlp: Dict, kind: str, num_experts: int,
                           expert_d_ff: int) -> Dict[str, np.ndarray]:
  """Returns expert weights {wi_0 [E,d,.], wi_1 [E,d,f], wo [E,f,d]} from a dense
  MLP's {wi_0, wi_1, wo}: expert e holds hidden slice e mod n of n = d_ff / f."""
  d_ff = mlp["wi_1"].shape[1]
  if d_ff % expert_d_ff or num_experts % (d_ff // expert_d_ff):
    raise ValueError(
        f"cannot upcycle a dense FFN of d_ff {d_ff} into {num_experts} experts of "
        f"{expert_d_ff}: need expert_d_ff to divide d_ff and d_ff / expert_d_ff "
        f"({d_ff / expert_d_ff:g}) to divide num_experts")
  num_slices = d_ff // expert_d_ff
  hidden = lambda s: slice(s * expert_d_ff, (s + 1) * expert_d_ff)

  def wi_0_slice(s):
    if wi_0_width(kind, d_ff) == d_ff:
      return mlp["wi_0"][:, hidden(s)]
    # OpenMoE's SwiGLU: wi_0 holds [x1 | x2], each d_ff wide; slice both halves.
    x1, x2 = np.split(mlp["wi_0"], 2, axis=1)
    return np.concatenate([x1[:, hidden(s)], x2[:, hidden(s)]], axis=1)

  slices = [s % num_slices for s in range(num_experts)]
  return {"wi_0": np.stack([wi_0_slice(s) for s in slices]),
          "wi_1": np.stack([mlp["wi_1"][:, hidden(s)] for s in slices]),
          "wo": np.stack([mlp["wo"][hidden(s), :] for s in slices])}


def upcycle_params(dense_params: Dict, dense_cfg: ModelConfig, moe_params: Dict,
                   moe_cfg: ModelConfig) -> Dict:
  """Returns `moe_params` (a freshly initialised MoE model; its routers are kept)
  with everything else taken from `dense_params`, FFNs turned into experts."""
  _check_compatible(dense_cfg, moe_cfg)
  out = jax.tree.map(lambda a: np.array(a), moe_params)
  for key in ("embed", "final_norm", "head"):
    out[key] = jax.tree.map(np.asarray, dense_params[key])
  for dense_slot, moe_slot in zip(layer_slots(dense_cfg), layer_slots(moe_cfg)):
    layer = get_layer(dense_params, dense_slot)
    if not moe_slot.sparse:
      set_layer(out, moe_slot, layer)
      continue
    experts = split_ffn_into_experts(layer["mlp"], moe_cfg.mlp_kind,
                                     moe_cfg.moe.num_experts, moe_cfg.expert_d_ff)
    set_layer(out, moe_slot, {
        "pre_attention_norm": layer["pre_attention_norm"],
        "attention": layer["attention"],
        "pre_moe_norm": layer["pre_mlp_norm"],
        "moe": {"experts": experts}})
  return out


def _check_compatible(dense_cfg: ModelConfig, moe_cfg: ModelConfig) -> None:
  if any(dense_cfg.sparse_layers()):
    raise ValueError("the dense checkpoint has MoE layers; upcycling needs a dense model")
  fields = ("vocab_size", "d_model", "num_heads", "head_dim", "d_ff", "num_layers",
            "mlp_kind", "scan_layers")
  differ = [f"{f}: dense {getattr(dense_cfg, f)} vs MoE {getattr(moe_cfg, f)}"
            for f in fields if getattr(dense_cfg, f) != getattr(moe_cfg, f)]
  if differ:
    raise ValueError("dense and MoE models differ in " + "; ".join(differ))
  moe = moe_cfg.moe
  if moe.residual_mlp or moe.num_shared_experts:
    raise ValueError("upcycling copies each dense FFN into the routed experts; set "
                     "MoeConfig.residual_mlp = False and num_shared_experts = 0 (an "
                     "extra dense or shared MLP would have no dense weights to copy)")


def upcycle(dense_dir: str, output_dir: str, gin_files: List[str],
            gin_bindings: List[str] = (), step: int = None, seed: int = 0,
            print_fn=print) -> Dict[str, Any]:
  """Writes the upcycled step-0 MoE checkpoint to `output_dir`; returns a summary."""
  if os.path.exists(os.path.join(output_dir, "checkpoints")):
    raise FileExistsError(f"{output_dir}/checkpoints exists; pick a new --output")
  dense_run = load_run(dense_dir)  # parses the dense run's config.gin
  step = dense_run.steps[-1] if step is None else step
  if step not in dense_run.steps:
    raise ValueError(f"no checkpoint at step {step} in {dense_dir}: {dense_run.steps}")
  dense_params = restore_params(dense_dir, step)
  print_fn(f"Dense checkpoint: {dense_dir} step {step}")

  import gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(gin_files, list(gin_bindings), finalize=False)
  vocab = pipeline.vocabulary_for(query("train.mixture_or_task_name"))
  moe_cfg = build_model_config(None, vocab.vocab_size)
  optimizer = query("train.optimizer")
  mesh = partitioning.make_mesh(num_devices=1)
  with partitioning.activate(mesh):
    init, _, _ = init_train_state(Decoder(moe_cfg), optimizer, mesh,
                                  jax.random.PRNGKey(seed), dense_run.sequence_length)
    fresh = init(jax.random.PRNGKey(seed))
  params = upcycle_params(dense_params, dense_run.config, fresh.params, moe_cfg)
  state = TrainState(step=np.zeros((), np.int32), params=params,
                     opt_state=optimizer.init(params))
  with Checkpointer(output_dir) as ckpt:
    ckpt.save(0, state, {"train_batches": 0}, force=True)
  summary = {"dense_checkpoint": os.path.abspath(dense_dir), "dense_step": step,
             "num_experts": moe_cfg.moe.num_experts, "expert_d_ff": moe_cfg.expert_d_ff,
             "slices_per_ffn": moe_cfg.d_ff // moe_cfg.expert_d_ff,
             "moe_layers": sum(moe_cfg.sparse_layers()), "gin_files": list(gin_files),
             "gin_bindings": list(gin_bindings)}
  with open(os.path.join(output_dir, "upcycle.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print_fn(f"Upcycled {summary['moe_layers']} FFNs into {summary['num_experts']} "
           f"experts each ({summary['slices_per_ffn']} slice(s) per FFN); wrote "
           f"{output_dir}/checkpoints/0. Continue with: openmoe-train "
           + " ".join(f"--gin_file={g}" for g in gin_files)
           + f" --gin.MODEL_DIR={output_dir}")
  return summary
