"""The training loop: sharded init or resume, jitted steps, eval, metrics, checkpoints.

`train()` is gin-configured; the command line lives in train.py. MODEL_DIR receives
checkpoints, TensorBoard events, metrics.jsonl and the operative config.gin.
"""
import contextlib
import dataclasses
import functools
import math
import os
import signal
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import flax.linen as nn
import flax.struct
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from openmoe_jax import gin_utils, partitioning
from openmoe_jax.checkpoints import Checkpointer, abstract_with_shardings
from openmoe_jax.config import ModelConfig
from openmoe_jax.convert import params_export
from openmoe_jax.data import pipeline
from openmoe_jax.metrics import MetricsLogger, ProgressPrinter
from openmoe_jax.model import Decoder
from openmoe_jax.objectives import CausalLm
from openmoe_jax.optim import learning_rate

VOCAB_MULTIPLE = 128  # embedding rows are padded so the vocab axis shards evenly


@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs besides the data position."""

  step: jax.Array
  params: Any
  opt_state: Any


def build_model_config(model_config: Optional[ModelConfig], vocab_size: int) -> ModelConfig:
  """Returns `model_config` (default: gin's ModelConfig()) with vocab_size filled in."""
  cfg = model_config or ModelConfig()
  if cfg.vocab_size is None:
    cfg = cfg.replace(vocab_size=-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
  elif cfg.vocab_size < vocab_size:
    raise ValueError(f"ModelConfig.vocab_size={cfg.vocab_size} is smaller than the "
                     f"task vocabulary ({vocab_size})")
  return cfg


def init_train_state(model: nn.Module, optimizer: optax.GradientTransformation,
                     mesh, rng: jax.Array, sequence_length: int):
  """Returns (init_fn, abstract unboxed state, state shardings).

  init_fn(rng) creates the state directly in its shardings (no host holds it whole).
  """
  def init_boxed(rng):
    params = model.init(rng, jnp.zeros((1, sequence_length), jnp.int32))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(nn.unbox(params)))

  abstract = jax.eval_shape(init_boxed, rng)
  shardings = TrainState(
      step=partitioning.replicated(mesh),
      params=partitioning.param_shardings(abstract.params, mesh),
      opt_state=_opt_state_shardings(abstract, mesh))
  init = jax.jit(lambda r: nn.unbox(init_boxed(r)), out_shardings=shardings)
  return init, _strip_boxes(abstract), shardings


def _strip_boxes(tree):
  """Returns `tree` with logical-partitioning boxes removed (no sharding constraint,
  so it also works on abstract values)."""
  is_box = lambda x: isinstance(x, nn.Partitioned)
  return jax.tree.map(lambda x: x.value if is_box(x) else x, tree, is_leaf=is_box)


def _opt_state_shardings(abstract_state: TrainState, mesh):
  """Returns shardings for the optimizer state: moments shaped like a parameter
  follow that parameter's sharding; everything else is replicated."""
  param_sh = partitioning.param_shardings(abstract_state.params, mesh)
  params = _strip_boxes(abstract_state.params)
  treedef = jax.tree.structure(params)
  mirrors = lambda x: jax.tree.structure(x) == treedef
  def shard(sub):
    if not mirrors(sub):
      return partitioning.replicated(mesh)
    return jax.tree.map(lambda leaf, p, s: s if leaf.shape == p.shape
                        else partitioning.replicated(mesh), sub, params, param_sh)
  return jax.tree.map(shard, abstract_state.opt_state, is_leaf=mirrors)


def make_train_step(model, objective, optimizer, microbatches: int = 1) -> Callable:
  """Returns train_step(state, batch, rng) -> (new state, scalar metrics).

  With `microbatches` k > 1 the batch is split into k equal slices whose gradients
  are accumulated; k slices of b rows give the loss and gradients of one batch of
  k*b rows: token-averaged terms are weighted by each slice's share of the batch's
  target tokens (decoder_loss_weights), router aux losses (means over groups) by 1/k.
  MoE groups must not straddle slices (group_size divides the slice's tokens).
  """
  def weighted_loss(params, batch, rng, total_tokens):
    loss, metrics = objective(model, params, batch, rng, train=True)
    aux = metrics["moe/aux_loss"]
    share = jnp.sum(batch["decoder_loss_weights"].astype(jnp.float32)) / total_tokens
    return share * (loss - aux) + aux / microbatches, metrics

  grad_fn = jax.value_and_grad(weighted_loss, has_aux=True)

  def accumulate(params, batch, rng, total_tokens):
    if microbatches == 1:
      (loss, metrics), grads = grad_fn(params, batch, rng, total_tokens)
      return loss, metrics, grads
    slices = jax.tree.map(lambda a: nn.with_logical_constraint(
        a.reshape((microbatches, -1) + a.shape[1:]), (None, "batch")), batch)

    def body(grads, xs):
      i, piece = xs
      (loss, metrics), g = grad_fn(params, piece, jax.random.fold_in(rng, i),
                                   total_tokens)
      return jax.tree.map(jnp.add, grads, g), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (losses, metrics) = jax.lax.scan(
        body, zeros, (jnp.arange(microbatches), slices))
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
    metrics["num_tokens"] = metrics["num_tokens"] * microbatches
    return jnp.sum(losses), metrics, grads

  def train_step(state: TrainState, batch, rng):
    step_rng = jax.random.fold_in(rng, state.step)
    total_tokens = jnp.maximum(
        jnp.sum(batch["decoder_loss_weights"].astype(jnp.float32)), 1.0)
    loss, metrics, grads = accumulate(state.params, batch, step_rng, total_tokens)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["loss"] = loss
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["learning_rate"] = learning_rate(opt_state)
    return TrainState(state.step + 1, params, opt_state), metrics
  return train_step


def make_eval_step(model, objective) -> Callable:
  """Returns eval_step(params, batch) -> scalar metrics (eval capacity factor)."""
  def eval_step(params, batch):
    _, metrics = objective(model, params, batch, jax.random.PRNGKey(0), train=False)
    return metrics
  return eval_step


def evaluate(eval_step, params, batches: Iterator[Dict[str, np.ndarray]],
             to_device: Callable) -> Dict[str, float]:
  """Returns metrics averaged over `batches`, weighted by real target tokens."""
  totals: Dict[str, float] = {}
  weight = 0.0
  for batch in batches:
    metrics = jax.device_get(eval_step(params, to_device(batch)))
    n = float(metrics["num_tokens"])
    for k, v in metrics.items():
      if k != "num_tokens":
        totals[k] = totals.get(k, 0.0) + float(v) * n
    weight += n
  if weight == 0:
    raise ValueError("evaluation saw no target tokens: is the split empty?")
  result = {k: v / weight for k, v in totals.items()}
  result["num_tokens"] = weight
  return result


def _mean_metrics(history) -> Dict[str, float]:
  fetched = jax.device_get(history)
  return {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Stage:
  """From `start_step` on, train on `mixture_or_task_name` with `objective` (None:
  train's objective), e.g. OpenMoE's UL2 stage on a code-heavy mixture, then causal
  LM on a mixture with less code."""

  start_step: int
  mixture_or_task_name: str
  objective: Any = None


def stage_index(stages, step: int) -> int:
  """Returns the index of the stage that runs training step `step` (1-based)."""
  return max(i for i, stage in enumerate(stages) if stage.start_step < max(step, 1))


@gin.configurable
def train(model_dir: str = gin.REQUIRED, mixture_or_task_name: str = gin.REQUIRED,
          train_steps: int = gin.REQUIRED, batch_size: int = gin.REQUIRED,
          sequence_length: int = gin.REQUIRED,
          optimizer: optax.GradientTransformation = gin.REQUIRED,
          model_config: Optional[ModelConfig] = None, objective: Any = None,
          eval_every_steps: int = 100, eval_batches: int = 8,
          eval_split: str = "validation", log_every_steps: int = 10,
          checkpoint_every_steps: int = 100, keep_checkpoints: int = 3,
          seed: int = 0, num_devices: Optional[int] = None, microbatches: int = 1,
          distributed: Optional[bool] = None, stages: Sequence[Stage] = (),
          print_fn: Callable[[str], None] = print) -> Dict[str, Any]:
  """Trains (or resumes) a Decoder; returns a summary dict (first/last eval loss,
  tokens/s, final step, train loss; `last_eval_metrics` and `last_train_metrics`:
  every metric of the last evaluation and of the last training log window).

  `stages`: a schedule of `Stage`s (the first starts at step 0); the switch happens
  at the given step and survives resume. Empty: one stage on mixture_or_task_name.

  `distributed`: call `jax.distributed.initialize()` (multi-host pods); None detects
  a multi-host TPU VM from its environment.
  """
  maybe_initialize_distributed(distributed)
  objective = objective or CausalLm()
  stages = tuple(stages) or (Stage(0, mixture_or_task_name, objective),)
  if stages[0].start_step != 0 or any(
      a.start_step >= b.start_step for a, b in zip(stages, stages[1:])):
    raise ValueError(f"train.stages must start at step 0 and increase: {stages}")
  vocab = pipeline.vocabulary_for(mixture_or_task_name)
  cfg = build_model_config(model_config, vocab.vocab_size)
  model = Decoder(cfg)
  mesh = partitioning.make_mesh(num_devices)
  shards = partitioning.batch_shards(mesh)
  if batch_size % (shards * microbatches) or batch_size % jax.process_count():
    raise ValueError(f"batch_size {batch_size} must be divisible by microbatches "
                     f"({microbatches}) x the {shards} batch shards of mesh "
                     f"{dict(mesh.shape)} (see make_mesh.* and train.microbatches)")
  batch_sh = partitioning.batch_sharding(mesh)
  to_device = lambda b: jax.tree.map(
      lambda a: jax.make_array_from_process_local_data(batch_sh, a), b)
  rng = jax.random.PRNGKey(seed)
  with partitioning.activate(mesh):
    init, abstract, state_sh = init_train_state(model, optimizer, mesh, rng,
                                                sequence_length)
    ckpt = Checkpointer(model_dir, checkpoint_every_steps, keep_checkpoints)
    if ckpt.latest_step() is not None:
      state, position = ckpt.restore(
          abstract_state=abstract_with_shardings(abstract, state_sh))
      print_fn(f"Resumed from step {int(state.step)} in {model_dir}")
    elif params_export.is_params_export(model_dir):
      state, position = _start_from_params_export(
          model_dir, optimizer, abstract, state_sh), {"train_batches": 0}
      print_fn(f"Starting from the params export in {model_dir} at step "
               f"{int(state.step)} (fresh optimizer state)")
    else:
      state, position = init(rng), {"train_batches": 0}
    start = int(state.step)
    _print_model_summary(print_fn, cfg, abstract.params, mesh)
    if start >= train_steps:
      print_fn(f"Nothing to train: the run is at step {start} and TRAIN_STEPS is "
               f"{train_steps} (raise --gin.TRAIN_STEPS to train further)")
    gin_utils.write_operative_config(model_dir)
    host_data = functools.partial(
        pipeline.get_dataset, sequence_length=sequence_length,
        batch_size=batch_size // jax.process_count(), shard_index=jax.process_index(),
        num_shards=jax.process_count())

    @functools.lru_cache(maxsize=None)
    def stage_parts(index: int):
      """Returns (train_step, run_eval, data) of stage `index`; data resumes."""
      stage = stages[index]
      stage_objective = stage.objective or objective
      train_step = jax.jit(
          make_train_step(model, stage_objective, optimizer, microbatches),
          in_shardings=(state_sh, batch_sh, partitioning.replicated(mesh)),
          out_shardings=(state_sh, partitioning.replicated(mesh)), donate_argnums=(0,))
      eval_step = jax.jit(make_eval_step(model, stage_objective))
      run_eval = lambda params: evaluate(eval_step, params, host_data(
          stage.mixture_or_task_name, split=eval_split, shuffle=False, repeat=False,
          num_batches=eval_batches), to_device)
      skip = max(position["train_batches"] - stage.start_step, 0)
      data = host_data(stage.mixture_or_task_name, seed=seed + index, skip_batches=skip)
      if len(stages) > 1:
        print_fn(f"Stage {index}: {stage.mixture_or_task_name} with "
                 f"{type(stage_objective).__name__} from step {stage.start_step}")
      return train_step, run_eval, data

    parts = lambda step: stage_parts(stage_index(stages, step))
    logger = MetricsLogger(model_dir, is_chief=jax.process_index() == 0)
    # Rows past the step this run starts from belong to steps it will run again.
    dropped = logger.drop_rows_after(start if start > 0 else -1)
    if dropped:
      print_fn(f"Dropped {dropped} metrics.jsonl row(s) past step {start} (steps "
               "that ran after the last checkpoint; this run repeats them)")
    loop = _Loop(parts, to_device, ckpt, logger, print_fn, rng,
                 tokens_per_batch=batch_size * sequence_length)
    summary = loop.run(state, train_steps, eval_every_steps, log_every_steps)
    if ckpt.saving_in_progress():
      print_fn(f"Waiting for the checkpoint of step {summary['final_step']} to be "
               "written ...")
    ckpt.close()
    logger.close()
  return summary


def _start_from_params_export(model_dir, optimizer, abstract, state_sh) -> TrainState:
  """Returns a TrainState holding a params export's parameters (restored straight
  into their shardings), a fresh optimizer state and the export's step."""
  params = params_export.restore(
      model_dir, abstract_with_shardings(abstract.params, state_sh.params))
  step = params_export.read_metadata(model_dir)["step"]
  fresh = jax.jit(lambda p: TrainState(step=jnp.asarray(step, jnp.int32), params=p,
                                       opt_state=optimizer.init(p)),
                  out_shardings=state_sh)
  return fresh(params)


def maybe_initialize_distributed(enabled: Optional[bool]) -> bool:
  """Initialises multi-host JAX when `enabled`, or when None and the environment is
  a multi-host TPU VM slice; returns whether it did."""
  if enabled is None:
    # libtpu may leave a warning sentence in this variable off-TPU: count only
    # entries that look like host names.
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")
             if h and not any(c.isspace() for c in h)]
    enabled = len(hosts) > 1 or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ
  if enabled:
    jax.distributed.initialize()
  return bool(enabled)


class _Loop:
  """Runs the steps with periodic logging, evaluation and checkpoints."""

  def __init__(self, parts, to_device, ckpt, logger, print_fn, rng, tokens_per_batch):
    # parts(step) -> (train_step, run_eval, data iterator) of the stage running `step`.
    self.parts, self.to_device = parts, to_device
    self.ckpt, self.logger, self.print_fn = ckpt, logger, print_fn
    self.rng, self.tokens_per_batch = rng, tokens_per_batch
    self.summary: Dict[str, Any] = {}
    self.steady_tokens_per_sec, self.all_tokens_per_sec = [], []

  def evaluate(self, step, params, write=True):
    """Prints (and, if `write`, logs) validation metrics at `step`."""
    metrics = self.parts(step)[1](params)
    if write:
      self.logger.write(step, {f"eval/{k}": v for k, v in metrics.items()})
    self.summary.setdefault("first_eval_ce_loss", metrics["ce_loss"])
    self.summary["last_eval_ce_loss"] = metrics["ce_loss"]
    # Older names of the two values above, kept for scripts reading the summary.
    self.summary["first_eval_loss"] = self.summary["first_eval_ce_loss"]
    self.summary["last_eval_loss"] = metrics["ce_loss"]
    self.summary["last_eval_metrics"] = metrics
    self.print_fn(f"eval @ step {step}: ce_loss {metrics['ce_loss']:.4f} "
                  f"accuracy {metrics['accuracy']:.3f} "
                  f"drop_fraction {metrics.get('moe/drop_fraction', 0.0):.3f}")

  def log(self, step, history, window_start, compiled_in_window, progress):
    """Writes the mean metrics of the steps in `history` and a progress line."""
    # Fetching the metrics waits for the window's steps (dispatch is asynchronous),
    # so the clock is read after it.
    means = _mean_metrics(history)
    tokens_per_sec = len(history) * self.tokens_per_batch / (
        time.perf_counter() - window_start)
    self.all_tokens_per_sec.append(tokens_per_sec)
    if not compiled_in_window:
      self.steady_tokens_per_sec.append(tokens_per_sec)
    # Routing statistics of training batches go under "moe/", as TensorBoard groups.
    scalars = {k if k.startswith("moe/") else f"train/{k}": v
               for k, v in means.items()}
    scalars["train/tokens_per_sec"] = tokens_per_sec
    self.logger.write(step, scalars)
    # `loss` everywhere (progress line, summary, metrics.jsonl) is the objective's
    # total: cross-entropy plus the auxiliary (router, z) losses; `ce_loss` is the
    # cross-entropy alone, the number evaluation reports.
    progress.update(step, scalars["train/loss"], tokens_per_sec)
    self.summary["last_train_loss"] = scalars["train/loss"]
    self.summary["last_train_ce_loss"] = scalars["train/ce_loss"]
    self.summary["last_train_metrics"] = scalars

  def run(self, state, train_steps, eval_every, log_every) -> Dict[str, Any]:
    """Trains from state.step to train_steps; returns the run summary."""
    start = int(state.step)
    self.summary["start_step"] = start
    if start == 0 or start >= train_steps:
      # A resumed run with nothing left evaluates again without a second row.
      self.evaluate(start, state.params, write=start == 0)
    progress = ProgressPrinter(train_steps, start, print_fn=self.print_fn)
    with stop_signals() as stop:
      state = self._steps(state, start, train_steps, eval_every, log_every, progress,
                          stop)
      final_step = int(state.step)
      if self.ckpt.latest_step() != final_step:
        self.ckpt.save(final_step, state, {"train_batches": final_step}, force=True)
    self.summary["final_step"] = final_step
    self.summary["preempted"] = bool(stop)
    self.summary["interrupted"] = "SIGINT" in stop
    if stop:
      how = "Ctrl-C" if "SIGINT" in stop else stop[0]
      self.print_fn(f"{how}: stopped after step {final_step}; checkpoint saved in "
                    f"{self.ckpt.directory}/{final_step}. Run the same command again "
                    "to resume from it.")
    # Windows that included compilation count only when no other window exists.
    rates = self.steady_tokens_per_sec or self.all_tokens_per_sec
    self.summary["tokens_per_sec"] = float(np.mean(rates)) if rates else None
    return self.summary

  def _steps(self, state, start, train_steps, eval_every, log_every, progress, stop):
    """Runs the steps until train_steps or a stop signal; returns the last state.

    At most one step waits in the device queue behind the one running, so a
    signal is acted on after the step in flight, not after a queue of them.
    """
    history, window_start, previous = [], time.perf_counter(), None
    for step in range(start + 1, train_steps + 1):
      train_step, _, data = self.parts(step)
      state, metrics = train_step(state, self.to_device(next(data)), self.rng)
      history.append(metrics)
      if previous is not None:
        jax.block_until_ready(previous)
      previous = metrics
      if step % log_every == 0 or step == train_steps or (stop and history):
        self.log(step, history, window_start,
                 compiled_in_window=step - len(history) == start, progress=progress)
        history, window_start = [], time.perf_counter()
      # The last step's checkpoint is forced here, so that it is written while the
      # final evaluation runs rather than after it.
      self.ckpt.save(step, state, {"train_batches": step},
                     force=step == train_steps or bool(stop))
      if stop:
        break
      if step % eval_every == 0 or step == train_steps:
        if step == train_steps:
          self.print_fn(f"Final evaluation at step {step} ...")
        self.evaluate(step, state.params)
        window_start = time.perf_counter()
    return state


@contextlib.contextmanager
def stop_signals(signals=(signal.SIGTERM, signal.SIGINT)):
  """Yields a list that receives the name of each stop signal that arrives
  ("SIGTERM": TPU VMs get one before maintenance or preemption; "SIGINT": Ctrl-C).

  The loop stops after the step in flight. After a first SIGINT, Ctrl-C gets its
  default action back: a second one kills the process at once. Previous handlers
  are restored on exit. Off the main thread no handler can be installed and the
  list stays empty.
  """
  flag = []
  if threading.current_thread() is not threading.main_thread():
    yield flag
    return

  def on_signal(signum, frame):
    del frame
    name = signal.Signals(signum).name
    flag.append(name)
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      # os.write: safe inside a handler, where print could meet a half-done print.
      os.write(2, b"\nCtrl-C: finishing the step in flight, then saving a checkpoint"
               b" (press Ctrl-C again to abort at once, without it)\n")

  previous = {s: signal.signal(s, on_signal) for s in signals}
  try:
    yield flag
  finally:
    for s, handler in previous.items():
      if not (s == signal.SIGINT and "SIGINT" in flag):  # keep: 2nd Ctrl-C kills
        signal.signal(s, handler)


def _print_model_summary(print_fn, cfg: ModelConfig, abstract_params, mesh):
  num = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
  moe_layers = [i for i, sparse in enumerate(cfg.sparse_layers()) if sparse]
  if moe_layers:
    kind = (f"MoE at layer{'s' if len(moe_layers) > 1 else ''} "
            f"{', '.join(map(str, moe_layers))}: {cfg.moe.num_experts} experts, "
            f"top-{cfg.moe.top_k}")
  else:
    kind = "dense, no MoE layer"
  print_fn(f"Model: {cfg.num_layers} layers ({kind}), d_model {cfg.d_model}, vocab "
           f"{cfg.vocab_size}: {num / 1e6:.1f}M parameters; mesh {dict(mesh.shape)}")
