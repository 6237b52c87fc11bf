"""Training: the train state, the Trainer that compiles the train and eval steps on a
mesh, and the gin-configured `train()` that builds a run from gin and drives it.

`train()` restores or initialises the state, writes checkpoints and metrics and runs
the step loop of train_loop.py; the command line lives in train.py. MODEL_DIR
receives checkpoints, TensorBoard events, metrics.jsonl and the operative config.gin.
"""
import contextlib
import copy
import dataclasses
import functools
import math
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import flax.linen as nn
import flax.struct
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from openmoe_jax import errors, flops, gin_utils, partitioning
from openmoe_jax import checkpoints
from openmoe_jax.checkpoints import Checkpointer, abstract_with_shardings
from openmoe_jax.config import ModelConfig, build_model_config
from openmoe_jax.convert import params_export
from openmoe_jax.distributed import maybe_initialize_distributed
from openmoe_jax.metrics import MetricsLogger
from openmoe_jax.model import Decoder
from openmoe_jax.objectives import CausalLm
from openmoe_jax.optim import learning_rate
from openmoe_jax.train_loop import SKIPPED, LoopStage, TrainLoop


@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs besides the data position."""

  step: jax.Array
  params: Any
  opt_state: Any


def init_train_state(model: nn.Module, optimizer: optax.GradientTransformation,
                     mesh, rng: jax.Array, sequence_length: int):
  """Returns (init_fn, abstract unboxed state, state shardings).

  init_fn(rng) creates the state directly in its shardings (no host holds it whole).
  Parameters are sharded by their logical axes, optimizer moments like the parameter
  they mirror (`partitioning.opt_state_shardings`), the step replicated.
  """
  def init_boxed(rng):
    params = model.init(rng, jnp.zeros((1, sequence_length), jnp.int32))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(nn.unbox(params)))

  abstract = jax.eval_shape(init_boxed, rng)
  shardings = TrainState(
      step=partitioning.replicated(mesh),
      params=partitioning.param_shardings(abstract.params, mesh),
      opt_state=partitioning.opt_state_shardings(abstract.opt_state, abstract.params,
                                                 mesh))
  init = jax.jit(lambda r: nn.unbox(init_boxed(r)), out_shardings=shardings)
  return init, _strip_boxes(abstract), shardings


def _strip_boxes(tree):
  """Returns `tree` with logical-partitioning boxes removed (no sharding constraint,
  so it also works on abstract values)."""
  is_box = lambda x: isinstance(x, nn.Partitioned)
  return jax.tree.map(lambda x: x.value if is_box(x) else x, tree, is_leaf=is_box)


def make_train_step(model, objective, optimizer, microbatches: int = 1) -> Callable:
  """Returns train_step(state, batch, rng) -> (new state, scalar metrics).

  With `microbatches` k > 1 the batch is split into k equal slices whose gradients
  are accumulated; k slices of b rows give the loss and gradients of one batch of
  k*b rows: token-averaged terms are weighted by each slice's share of the batch's
  target tokens (decoder_loss_weights), router aux losses (means over groups) by 1/k.
  MoE groups must not straddle slices (group_size divides the slice's tokens).

  A step whose loss or gradient norm is not finite (NaN/Inf) is skipped: the new
  state keeps the old parameters and optimizer state (so the learning-rate schedule
  does not advance either) but the step counter advances, because it counts the
  batches consumed: the bad batch is not retried. metrics["skipped_steps"] is 1.0
  for a skipped step, else 0.0.
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
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(operands):
      grads, opt_state, params = operands
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    # A conditional, not a select between the updated and the old state: the
    # select keeps both states alive at once. openmoe-plan, OpenMoE-base (16
    # experts) at 4 x 2048 tokens on v5e:2x2: peak 17.8 GiB per chip with the
    # select (does not fit), 15.4 GiB with the conditional. On the CPU the
    # quickstart's step ran 2.3% faster (two series of 16 pairs, one process each).
    params, opt_state = jax.lax.cond(
        finite, update, lambda operands: (operands[2], operands[1]),
        (grads, state.opt_state, state.params))
    metrics["loss"] = loss
    metrics["grad_norm"] = grad_norm
    metrics["learning_rate"] = learning_rate(opt_state)
    metrics["skipped_steps"] = 1.0 - finite.astype(jnp.float32)
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


class Trainer:
  """A model, its objective and optimizer on a mesh: the train state's layout and
  the compiled train and eval steps.

  Methods take host-local batches (numpy, this process's rows) and place them on the
  mesh. Build and call it inside `partitioning.activate(mesh)`.
  """

  def __init__(self, model: nn.Module, objective, optimizer: optax.GradientTransformation,
               mesh, sequence_length: int, microbatches: int = 1):
    self.model, self.objective, self.optimizer, self.mesh = (
        model, objective, optimizer, mesh)
    self.microbatches = microbatches
    self._init, self.abstract_state, self.state_shardings = init_train_state(
        model, optimizer, mesh, jax.random.PRNGKey(0), sequence_length)
    self.batch_sharding = partitioning.batch_sharding(mesh)
    self._compile_steps()

  def _compile_steps(self):
    replicated = partitioning.replicated(self.mesh)
    self._train_step = jax.jit(
        make_train_step(self.model, self.objective, self.optimizer, self.microbatches),
        in_shardings=(self.state_shardings, self.batch_sharding, replicated),
        out_shardings=(self.state_shardings, replicated), donate_argnums=(0,))
    self._eval_step = jax.jit(make_eval_step(self.model, self.objective))

  def with_objective(self, objective) -> "Trainer":
    """Returns a Trainer with this one's model, optimizer, mesh and state layout whose
    steps train and evaluate `objective`."""
    other = copy.copy(self)
    other.objective = objective
    other._compile_steps()  # pylint: disable=protected-access
    return other

  def init_state(self, rng: jax.Array) -> TrainState:
    """Returns a fresh TrainState at step 0, created in its shardings."""
    return self._init(rng)

  def abstract_state_with_shardings(self) -> TrainState:
    """Returns the abstract TrainState carrying its shardings (a restore target)."""
    return abstract_with_shardings(self.abstract_state, self.state_shardings)

  def state_from_params(self, params, step: int) -> TrainState:
    """Returns a TrainState at `step` holding `params` and a fresh optimizer state."""
    fresh = jax.jit(lambda p: TrainState(step=jnp.asarray(step, jnp.int32), params=p,
                                         opt_state=self.optimizer.init(p)),
                    out_shardings=self.state_shardings)
    return fresh(params)

  def device_batch(self, batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
    """Returns this process's rows of a batch as global arrays split over the mesh."""
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(self.batch_sharding, a), batch)

  def train_step(self, state: TrainState, batch: Dict[str, np.ndarray], rng: jax.Array):
    """Returns (new state, scalar metrics) after one optimizer step on `batch`.
    `state` is donated: do not use it afterwards."""
    return self._train_step(state, self.device_batch(batch), rng)

  def eval_step(self, params, batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
    """Returns the objective's scalar metrics on `batch` (eval capacity factor)."""
    return self._eval_step(params, self.device_batch(batch))

  def evaluate(self, params, batches: Iterator[Dict[str, np.ndarray]]) -> Dict[str, float]:
    """Returns metrics averaged over `batches`, weighted by real target tokens."""
    return evaluate(self._eval_step, params, batches, self.device_batch)


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
          distributed: Optional[bool] = None, data_shards: Optional[int] = None,
          stages: Sequence[Stage] = (),
          restore_fallback: bool = True, max_consecutive_skipped_steps: int = 10,
          peak_flops_per_sec: Optional[float] = None,
          print_fn: Callable[[str], None] = print) -> Dict[str, Any]:
  """Trains (or resumes) a Decoder; returns a summary dict (first/last eval loss,
  tokens/s, final step, train loss; `last_eval_metrics` and `last_train_metrics`:
  every metric of the last evaluation and of the last training log window).

  `stages`: a schedule of `Stage`s (the first starts at step 0); the switch happens
  at the given step and survives resume. Empty: one stage on mixture_or_task_name.

  `distributed`: run as one of several processes (`maybe_initialize_distributed`:
  coordinator address, process count and id from gin or the environment); None
  detects a multi-host TPU VM, or a process count > 1 given, from the environment.

  `data_shards`: the training and eval data are read as this many disjoint shards
  (seqio ShardInfo), each giving batch_size / data_shards rows of every global
  batch, shard 0's rows first; process p reads shards p*k to p*k+k-1 (k =
  data_shards / process count). None: one shard per process. A run relaunched on a
  different number of processes with the same data_shards sees the same batches.

  Before anything is compiled, MODEL_DIR must be writable
  (`checkpoints.UnwritableDirectoryError`) and every stage's train and eval data
  files must exist and parse (`pipeline.DataFileError`). Partial saves of a killed
  run are deleted. `restore_fallback`: a damaged latest checkpoint is reported and
  the previous complete one restored (True, the default), or the run stops
  (`checkpoints.CheckpointDamagedError`). A checkpoint that does not fit the model
  raises `checkpoints.CheckpointMismatchError` and changes nothing on disk.

  A step whose loss or gradient norm is not finite leaves the parameters and the
  optimizer state unchanged (`train/skipped_steps`); `max_consecutive_skipped_steps`
  of them in a row stop the run with `train_loop.TrainingDivergedError`.
  `peak_flops_per_sec`: a device's peak for `mfu` (None: TPU spec or measured; flops.py)
  """
  # Imported here, not at the top: seqio and TensorFlow feed only `train`'s data, so
  # `Trainer` and the step builders import without them (benchmarks on a GPU image).
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  maybe_initialize_distributed(distributed)
  objective = objective or CausalLm()
  stages = tuple(stages) or (Stage(0, mixture_or_task_name, objective),)
  if stages[0].start_step != 0 or any(
      a.start_step >= b.start_step for a, b in zip(stages, stages[1:])):
    raise ValueError(f"train.stages must start at step 0 and increase: {stages}")
  checkpoints.check_writable(model_dir)
  for name in sorted({stage.mixture_or_task_name for stage in stages}):
    pipeline.validate_data(name, splits=("train", eval_split))
  vocab = pipeline.vocabulary_for(mixture_or_task_name)
  cfg = build_model_config(model_config, vocab.vocab_size)
  mesh = partitioning.make_mesh(num_devices)
  shards = partitioning.batch_shards(mesh)
  if batch_size % (shards * microbatches) or batch_size % jax.process_count():
    raise ValueError(f"batch_size {batch_size} must be divisible by microbatches "
                     f"({microbatches}) x the {shards} batch shards of mesh "
                     f"{dict(mesh.shape)} (see make_mesh.* and train.microbatches)")
  my_shards, num_data_shards = data_shards_of_process(
      data_shards, batch_size, jax.process_index(), jax.process_count())
  rng = jax.random.PRNGKey(seed)
  meter = flops.mfu_meter(cfg, sequence_length, batch_size // microbatches
                          * sequence_length, mesh, peak_flops_per_sec, print_fn)
  with partitioning.activate(mesh), contextlib.ExitStack() as cleanup:
    trainer = Trainer(Decoder(cfg), objective, optimizer, mesh, sequence_length,
                      microbatches)
    ckpt = Checkpointer(model_dir, checkpoint_every_steps, keep_checkpoints,
                        restore_fallback=restore_fallback, print_fn=print_fn)
    cleanup.callback(ckpt.close)  # waits for a checkpoint still being written
    for path in ckpt.remove_partial_saves():
      print_fn(f"Removed {path}: a checkpoint whose writing was interrupted")
    state, position = _initial_state(trainer, ckpt, model_dir, rng, print_fn)
    start = int(state.step)
    # Steps the state counts that drew no batch from this run's data (a params
    # export's step; 0 for a run started or resumed here).
    steps_before_data = start - position["train_batches"]
    _print_model_summary(print_fn, cfg, trainer.abstract_state.params, mesh)
    if start >= train_steps:
      print_fn(f"Nothing to train: the run is at step {start} and TRAIN_STEPS is "
               f"{train_steps} (raise --gin.TRAIN_STEPS to train further)")
    if jax.process_index() == 0:
      gin_utils.write_operative_config(model_dir)
    host_passes = functools.partial(
        pipeline.sharded_passes, sequence_length=sequence_length,
        batch_size=batch_size // jax.process_count(), shard_indices=my_shards,
        num_shards=num_data_shards)
    stage_for_step = _stage_schedule(
        trainer, stages, host_passes, rng=rng, seed=seed,
        trained_batches=position["train_batches"], eval_split=eval_split,
        eval_batches=eval_batches, print_fn=print_fn,
        steps_before_data=steps_before_data)
    logger = MetricsLogger(model_dir, is_chief=jax.process_index() == 0)
    cleanup.callback(logger.close)
    # Rows past the step this run starts from belong to steps it will run again.
    dropped = logger.drop_rows_after(start if start > 0 else -1)
    if dropped:
      print_fn(f"Dropped {dropped} metrics.jsonl row(s) past step {start} (steps "
               "that ran after the last checkpoint; this run repeats them)")
    loop = TrainLoop(stage_for_step, ckpt, logger, print_fn,
                     tokens_per_batch=batch_size * sequence_length, mfu_meter=meter,
                     max_consecutive_skipped=max_consecutive_skipped_steps,
                     skipped_steps=position.get(SKIPPED, 0),
                     steps_before_data=steps_before_data)
    summary = loop.run(state, train_steps, eval_every_steps, log_every_steps)
    if ckpt.saving_in_progress():
      print_fn(f"Waiting for the checkpoint of step {summary['final_step']} to be "
               "written ...")
  return summary


def data_shards_of_process(data_shards: Optional[int], batch_size: int,
                           process_index: int, process_count: int
                           ) -> tuple[tuple[int, ...], int]:
  """Returns (the data shards process `process_index` reads, the number of shards):
  `data_shards` (None: one per process) split into equal consecutive runs, one per
  process. Raises InputError unless the shards divide among the processes and the
  batch among the shards."""
  num = process_count if data_shards is None else int(data_shards)
  if num < 1 or num % process_count or batch_size % num:
    raise errors.InputError(
        f"train.data_shards={data_shards}: the number of data shards must be a "
        f"multiple of the {process_count} process(es) and divide batch_size "
        f"{batch_size}")
  per = num // process_count
  return tuple(range(process_index * per, (process_index + 1) * per)), num


def _initial_state(trainer: Trainer, ckpt: Checkpointer, model_dir: str,
                   rng: jax.Array, print_fn) -> tuple:
  """Returns (state, data position): the newest checkpoint's, else a params
  export's parameters with a fresh optimizer state, else a fresh state."""
  if ckpt.latest_step() is not None:
    state, position = ckpt.restore(
        abstract_state=trainer.abstract_state_with_shardings())
    print_fn(f"Resumed from step {int(state.step)} in {model_dir}")
    return state, position
  if params_export.is_params_export(model_dir):
    params = params_export.restore(model_dir, abstract_with_shardings(
        trainer.abstract_state.params, trainer.state_shardings.params))
    state = trainer.state_from_params(
        params, params_export.read_metadata(model_dir)["step"])
    print_fn(f"Starting from the params export in {model_dir} at step "
             f"{int(state.step)} (fresh optimizer state)")
    return state, {"train_batches": 0}
  return trainer.init_state(rng), {"train_batches": 0}


def _stage_schedule(trainer: Trainer, stages: Sequence[Stage], host_passes, *, rng, seed,
                    trained_batches: int, eval_split: str, eval_batches: int,
                    print_fn, steps_before_data: int = 0) -> Callable[[int], LoopStage]:
  """Returns stage_for_step(step) -> the LoopStage that runs training step `step`.

  A stage is built when its first step comes: its Trainer (train's, or one for the
  stage's own objective), its training data, resumed past the batches it drew of
  the `trained_batches` this run's data gave (steps after `steps_before_data`, the
  step a params export started the run at), and its eval data (`host_passes` builds
  the pipeline once; each evaluation starts a new pass over the same batches).
  """
  @functools.lru_cache(maxsize=None)
  def build(index: int) -> LoopStage:
    stage = stages[index]
    same = stage.objective is None or stage.objective is trainer.objective
    stage_trainer = trainer if same else trainer.with_objective(stage.objective)
    skip = max(trained_batches - max(stage.start_step - steps_before_data, 0), 0)
    batches = host_passes(stage.mixture_or_task_name, seed=seed + index,
                          skip_batches=skip)()
    # Built once per stage: each evaluation replays the same batches.
    eval_pass = host_passes(stage.mixture_or_task_name, split=eval_split,
                            shuffle=False, repeat=False, num_batches=eval_batches)
    if len(stages) > 1:
      print_fn(f"Stage {index}: {stage.mixture_or_task_name} with "
               f"{type(stage_trainer.objective).__name__} from step {stage.start_step}")
    return LoopStage(
        train_step=lambda state, batch: stage_trainer.train_step(state, batch, rng),
        evaluate=lambda params: stage_trainer.evaluate(params, eval_pass()),
        batches=batches)

  return lambda step: build(stage_index(stages, step))


def _print_model_summary(print_fn, cfg: ModelConfig, abstract_params, mesh):
  num = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
  moe_layers = cfg.moe_layer_numbers()
  if moe_layers:
    kind = (f"MoE at layer{'s' if len(moe_layers) > 1 else ''} "
            f"{', '.join(map(str, moe_layers))}: {cfg.moe.num_experts} experts, "
            f"top-{cfg.moe.top_k}")
  else:
    kind = "dense, no MoE layer"
  print_fn(f"Model: {cfg.num_layers} layers ({kind}), d_model {cfg.d_model}, vocab "
           f"{cfg.vocab_size}: {num / 1e6:.1f}M parameters; mesh {dict(mesh.shape)}")
