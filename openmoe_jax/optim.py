"""Optimizers and learning-rate schedules, chosen by gin references.

Builders are gin configurables that return an `optax.GradientTransformation`, e.g.
`train.optimizer = @adafactor_openmoe()`. The learning rate is injected as a
hyperparameter (`optax.inject_hyperparams`) so the trainer can read the value used at
each step from the optimizer state with `learning_rate(opt_state)`.
"""
from collections.abc import Callable

import gin
import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[jax.Array | int], jax.Array]


def rsqrt_schedule(learning_rate: float, warmup_steps: int) -> Schedule:
  """Returns t5x's 'constant * rsqrt_decay' schedule as OpenMoE trained with it.

  lr(step) = learning_rate * sqrt(warmup_steps / max(step, warmup_steps)): constant
  for the first `warmup_steps`, then decaying as 1/sqrt(step). With t5x's base rate
  1.0 and 10k warmup steps this is 0.01 constant, then 1/sqrt(step).
  """
  if warmup_steps < 1:
    raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")

  def schedule(step):
    step = jnp.maximum(jnp.asarray(step, jnp.float32), float(warmup_steps))
    return learning_rate * jnp.sqrt(warmup_steps / step)

  return schedule


def warmup_cosine_schedule(peak_lr: float, warmup_steps: int, total_steps: int,
                           end_lr_ratio: float = 0.1) -> Schedule:
  """Returns a schedule: linear 0 -> peak_lr over warmup_steps, then cosine decay
  to peak_lr * end_lr_ratio at total_steps (held there afterwards)."""
  if total_steps <= warmup_steps:
    raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak_lr, warmup_steps=warmup_steps,
      decay_steps=total_steps, end_value=peak_lr * end_lr_ratio)


def _decay_matrices_only(params):
  # Norm scales and biases (rank <= 1) are not decayed.
  return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


@gin.configurable
def adafactor_openmoe(learning_rate: float = 0.01,
                      warmup_steps: int = 10000,
                      decay_rate: float = 0.8,
                      clipping_threshold: float | None = 1.0,
                      min_dim_size_to_factor: int = 128,
                      multiply_by_parameter_scale: bool = True,
                      momentum: float | None = None,
                      weight_decay_rate: float | None = None,
                      ) -> optax.GradientTransformation:
  """Returns OpenMoE's optimizer: Adafactor with factored second moments and the
  rsqrt schedule (`rsqrt_schedule(learning_rate, warmup_steps)`)."""

  def make(learning_rate):
    return optax.adafactor(
        learning_rate=learning_rate,
        min_dim_size_to_factor=min_dim_size_to_factor,
        decay_rate=decay_rate,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        clipping_threshold=clipping_threshold,
        momentum=momentum,
        weight_decay_rate=weight_decay_rate,
        factored=True)

  return optax.inject_hyperparams(make)(
      learning_rate=rsqrt_schedule(learning_rate, warmup_steps))


def wsd_schedule(peak_lr: float, warmup_steps: int, total_steps: int,
                 decay_fraction: float = 0.1, end_lr: float = 0.0) -> Schedule:
  """Returns warmup-stable-decay: linear 0 -> peak_lr over warmup_steps, constant,
  then linear decay to end_lr over the last decay_fraction of total_steps."""
  decay_steps = int(round(total_steps * decay_fraction))
  if not 0 < decay_fraction <= 1 or total_steps - decay_steps < warmup_steps:
    raise ValueError(f"wsd: need 0 < decay_fraction <= 1 and warmup_steps "
                     f"({warmup_steps}) <= the {total_steps - decay_steps} steps "
                     "before the decay")
  return optax.join_schedules([
      optax.linear_schedule(0.0, peak_lr, warmup_steps),
      optax.constant_schedule(peak_lr),
      optax.linear_schedule(peak_lr, end_lr, decay_steps),
  ], boundaries=[warmup_steps, total_steps - decay_steps])


def _adamw(schedule: Schedule, b1: float, b2: float, weight_decay: float,
           clip_norm: float | None, eps: float) -> optax.GradientTransformation:
  """Returns AdamW (decoupled weight decay on rank >= 2 params only) after global-norm
  clipping (clip_norm=None: none), its learning rate injected from `schedule`."""

  def make(learning_rate):
    adamw = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps,
                        weight_decay=weight_decay, mask=_decay_matrices_only)
    if clip_norm is None:
      return adamw
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)

  return optax.inject_hyperparams(make)(learning_rate=schedule)


@gin.configurable
def adamw_warmup_cosine(peak_lr: float = 3e-4,
                        warmup_steps: int = 1000,
                        total_steps: int = gin.REQUIRED,
                        end_lr_ratio: float = 0.1,
                        b1: float = 0.9,
                        b2: float = 0.95,
                        weight_decay: float = 0.1,
                        clip_norm: float | None = 1.0,
                        eps: float = 1e-8,
                        ) -> optax.GradientTransformation:
  """Returns AdamW (see `_adamw`) with `warmup_cosine_schedule(peak_lr, warmup_steps,
  total_steps, end_lr_ratio)`. Raises ValueError naming the bindings to change when
  total_steps <= warmup_steps."""
  if total_steps <= warmup_steps:
    raise ValueError(
        f"adamw_warmup_cosine.total_steps ({total_steps}; the run files bind it to "
        f"TRAIN_STEPS) must exceed adamw_warmup_cosine.warmup_steps ({warmup_steps}): "
        f"train at least {warmup_steps + 1} steps or lower the warmup, e.g. "
        f"--gin.adamw_warmup_cosine.warmup_steps={max(1, total_steps // 10)}")
  return _adamw(warmup_cosine_schedule(peak_lr, warmup_steps, total_steps, end_lr_ratio),
                b1, b2, weight_decay, clip_norm, eps)


@gin.configurable
def adamw_wsd(peak_lr: float = 2e-4,
              warmup_steps: int = 2000,
              total_steps: int = gin.REQUIRED,
              decay_fraction: float = 0.1,
              end_lr: float = 2e-5,
              b1: float = 0.9,
              b2: float = 0.95,
              weight_decay: float = 0.1,
              clip_norm: float | None = 1.0,
              eps: float = 1e-8,
              ) -> optax.GradientTransformation:
  """Returns AdamW (see `_adamw`) with `wsd_schedule` (OpenMoE 2's recipe: 2e-4 ->
  2e-5, betas (0.9, 0.95), weight decay 0.1, clipping at 1.0)."""
  return _adamw(wsd_schedule(peak_lr, warmup_steps, total_steps, decay_fraction, end_lr),
                b1, b2, weight_decay, clip_norm, eps)


def learning_rate(opt_state) -> jax.Array:
  """Returns the learning rate applied by the latest update (the step's lr).

  Reads the 'learning_rate' hyperparameter of the first `optax.inject_hyperparams`
  state found in `opt_state`; raises ValueError when there is none.
  """
  injected_types = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
  is_injected = lambda x: isinstance(x, injected_types)
  for leaf in jax.tree.leaves(opt_state, is_leaf=is_injected):
    if is_injected(leaf) and "learning_rate" in leaf.hyperparams:
      return leaf.hyperparams["learning_rate"]
  raise ValueError("optimizer state has no injected 'learning_rate' hyperparameter")
