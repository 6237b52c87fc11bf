"""Tests for openmoe_jax.optim: schedules numerically, optimizers end to end."""
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from openmoe_jax import optim


def test_rsqrt_schedule_matches_t5x_rsqrt_decay():
  schedule = optim.rsqrt_schedule(learning_rate=0.01, warmup_steps=10000)
  for step in (0, 1, 5000, 10000):
    assert float(schedule(step)) == pytest.approx(0.01)
  # t5x 'constant * rsqrt_decay' with base 1.0: 1 / sqrt(max(step, warmup)).
  for step in (10001, 40000, 250000, 500000):
    assert float(schedule(step)) == pytest.approx(1 / np.sqrt(step), rel=1e-6)
  assert float(schedule(40000)) == pytest.approx(0.005)
  with pytest.raises(ValueError):
    optim.rsqrt_schedule(0.01, 0)


def test_warmup_cosine_schedule_endpoints():
  schedule = optim.warmup_cosine_schedule(peak_lr=1e-3, warmup_steps=10, total_steps=110,
                                          end_lr_ratio=0.1)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(5e-4)
  assert float(schedule(10)) == pytest.approx(1e-3)
  assert float(schedule(60)) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4), rel=1e-5)
  assert float(schedule(110)) == pytest.approx(1e-4)
  assert float(schedule(1000)) == pytest.approx(1e-4)
  with pytest.raises(ValueError, match=r"total_steps \(10\) must exceed warmup_steps \(10\)"):
    optim.warmup_cosine_schedule(peak_lr=1e-3, warmup_steps=10, total_steps=10)


def test_wsd_schedule_defaults_decay_the_last_tenth_to_zero():
  lr = optim.wsd_schedule(1.0, warmup_steps=10, total_steps=100)
  np.testing.assert_allclose([float(lr(s)) for s in (89, 90, 95, 100, 120)],
                             [1.0, 1.0, 0.5, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("fraction, warmup, refused", [
    (0.1, 90, False), (0.1, 91, True), (1.0, 0, False), (1.0, 1, True),
    (0.0, 0, True), (1.5, 0, True)])
def test_wsd_schedule_needs_a_decay_fraction_in_0_1_and_warmup_before_the_decay(
    fraction, warmup, refused):
  build = lambda: optim.wsd_schedule(1.0, warmup, total_steps=100,
                                     decay_fraction=fraction)
  if not refused:
    assert float(build()(100)) == 0.0
    return
  steps_before = 100 - int(round(100 * fraction))
  with pytest.raises(ValueError, match=rf"warmup_steps \({warmup}\) <= the "
                     rf"{steps_before} steps before the decay"):
    build()


@pytest.mark.parametrize("total, warmup, at_least, suggested", [
    (10, 10, 11, 1), (50, 100, 101, 5), (9, 100, 101, 1)])
def test_adamw_warmup_cosine_names_the_steps_and_a_warmup_that_fit(
    total, warmup, at_least, suggested):
  with pytest.raises(ValueError, match=rf"train at least {at_least} steps or lower the "
                     rf"warmup, e.g. --gin.adamw_warmup_cosine.warmup_steps={suggested}\b"):
    optim.adamw_warmup_cosine(total_steps=total, warmup_steps=warmup)
  assert isinstance(optim.adamw_warmup_cosine(total_steps=warmup + 1,
                                              warmup_steps=warmup),
                    optax.GradientTransformation)


def _quadratic_run(tx, steps=30):
  params = {"w": jnp.full((256, 160), 2.0), "b": jnp.full((160,), -1.0)}
  loss = lambda p: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  first = float(loss(params))
  lrs = []
  for _ in range(steps):
    params, state = step(params, state)
    lrs.append(float(optim.learning_rate(state)))
  return first, float(loss(params)), lrs, state


def test_adafactor_factors_and_decreases_loss():
  tx = optim.adafactor_openmoe(learning_rate=0.01, warmup_steps=10)
  first, last, lrs, state = _quadratic_run(tx)
  assert last < first
  assert lrs[0] == pytest.approx(0.01)
  assert lrs[-1] == pytest.approx(0.01 * np.sqrt(10 / 29), rel=1e-5)  # last update: count 29
  factored = [s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "v_row"))
              if hasattr(s, "v_row")][0]
  # Second moments of the (256, 160) matrix are stored as a row and a column vector.
  assert {factored.v_row["w"].shape, factored.v_col["w"].shape} == {(256,), (160,)}
  assert factored.v["w"].shape == (1,)


def test_adamw_warmup_cosine_decreases_loss_and_reports_lr():
  tx = optim.adamw_warmup_cosine(peak_lr=1e-1, warmup_steps=5, total_steps=30)
  first, last, lrs, _ = _quadratic_run(tx)
  assert last < first
  assert lrs[0] == 0.0 and lrs[5] == pytest.approx(0.1)
  assert lrs[-1] < lrs[10]


def test_gin_selects_optimizer():
  gin.parse_config("""
      adamw_warmup_cosine.peak_lr = 0.5
      adamw_warmup_cosine.total_steps = 100
      adamw_warmup_cosine.warmup_steps = 10
  """)
  tx = gin.get_configurable("adamw_warmup_cosine")()
  state = tx.init({"w": jnp.ones((2, 2))})
  assert isinstance(tx, optax.GradientTransformation)
  assert float(state.hyperparams["learning_rate"]) == 0.0
  gin.clear_config()
  with pytest.raises(RuntimeError, match="total_steps"):
    optim.adamw_warmup_cosine()


def test_learning_rate_without_injection_raises():
  with pytest.raises(ValueError):
    optim.learning_rate(optax.sgd(0.1).init({"w": jnp.ones(2)}))


def test_learning_rate_is_found_after_other_states_and_injections():
  tx = optax.chain(optax.scale_by_adam(),
                   optax.inject_hyperparams(optax.scale)(step_size=-2.0),
                   optax.inject_hyperparams(optax.sgd)(learning_rate=0.25))
  assert float(optim.learning_rate(tx.init({"w": jnp.ones(2)}))) == 0.25


@pytest.mark.parametrize("build", [
    lambda: optim.adamw_warmup_cosine(peak_lr=0.1, warmup_steps=1, total_steps=30,
                                      weight_decay=0.2),
    lambda: optim.adamw_wsd(peak_lr=0.1, warmup_steps=1, total_steps=30,
                            weight_decay=0.2),
], ids=["warmup_cosine", "wsd"])
def test_adamw_decays_matrices_and_expert_stacks_but_not_norm_scales_or_scalars(build):
  """With zero gradients Adam's step is 0, so each update is only the decoupled
  decay -lr * wd * p: matrices (and [E, d, f] expert stacks) shrink by (1 - lr wd)
  per step, norm scales / biases (rank 1) and scalars stay exactly as they were."""
  tx = build()
  params = {"kernel": jnp.full((4, 3), 2.0), "experts": jnp.full((2, 4, 3), -3.0),
            "scale": jnp.full((3,), 1.5), "bias": jnp.full((4,), -0.5),
            "scalar": jnp.asarray(0.7)}
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  factor = 1.0
  for _ in range(3):
    updates, state = tx.update(zeros, state, params)
    params = optax.apply_updates(params, updates)
    factor *= 1.0 - float(optim.learning_rate(state)) * 0.2
  assert factor < 0.99  # the learning rate was positive for some step
  np.testing.assert_allclose(params["kernel"], np.full((4, 3), 2.0 * factor), rtol=1e-6)
  np.testing.assert_allclose(params["experts"], np.full((2, 4, 3), -3.0 * factor),
                             rtol=1e-6)
  np.testing.assert_array_equal(params["scale"], np.full((3,), 1.5, np.float32))
  np.testing.assert_array_equal(params["bias"], np.full((4,), -0.5, np.float32))
  np.testing.assert_array_equal(params["scalar"], np.float32(0.7))


def _gradients(shapes, scales, seed=0):
  """Returns one gradient tree per scale: normal draws times the scale (the steps'
  gradients differ in direction and global norm)."""
  rng = np.random.default_rng(seed)
  return [{k: (scale * rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}
          for scale in scales]


def _numpy_adamw(params, grads, lrs, b1, b2, eps, wd, clip_norm):
  """Returns the parameters after AdamW by the paper, in float64: bias-corrected
  moments (their step count from 0), decoupled decay on matrices only, after
  clipping the global gradient norm at clip_norm (None: no clipping); step t at
  learning rate lrs[t]."""
  ref = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: np.zeros(v.shape) for k, v in params.items()}
  v = {k: np.zeros(p.shape) for k, p in params.items()}
  for t, (g, lr) in enumerate(zip(grads, lrs)):
    norm = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in g.values()))
    clip = min(1.0, clip_norm / norm) if clip_norm and norm > 0 else 1.0
    for k in params:
      gk = g[k] * clip
      m[k] = b1 * m[k] + (1 - b1) * gk
      v[k] = b2 * v[k] + (1 - b2) * gk ** 2
      step = (m[k] / (1 - b1 ** (t + 1))) / (np.sqrt(v[k] / (1 - b2 ** (t + 1))) + eps)
      decay = wd * ref[k] if ref[k].ndim > 1 else 0.0
      ref[k] = ref[k] - lr * (step + decay)
  return ref


def _run(tx, params, grads, start_count=0):
  """Returns (params, learning rates) after tx's updates with `grads`, its schedule
  started at step `start_count` (the inner optimizer's own counts start at 0)."""
  state = tx.init(jax.tree.map(jnp.asarray, params))
  at = lambda count: jnp.full_like(count, start_count)
  state = state._replace(count=at(state.count), hyperparams_states={
      k: s._replace(count=at(s.count)) for k, s in state.hyperparams_states.items()})
  ours, lrs = jax.tree.map(jnp.asarray, params), []
  for g in grads:
    updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, ours)
    ours = optax.apply_updates(ours, updates)
    lrs.append(float(optim.learning_rate(state)))
  return ours, lrs


@pytest.mark.parametrize("clip_norm", [1.0, None])
def test_adamw_steps_equal_a_numpy_adamw_with_global_norm_clipping(clip_norm):
  """AdamW by the paper (bias-corrected moments, decoupled decay on matrices only)
  after clipping the global gradient norm at 1, on gradients whose norms are above
  and below 1, so clipping changes the direction of the moments' history; with
  clip_norm None, no clipping."""
  b1, b2, eps, wd, peak, end = 0.8, 0.9, 1e-6, 0.1, 0.1, 0.01
  tx = optim.adamw_warmup_cosine(peak_lr=peak, warmup_steps=1, total_steps=5,
                                 end_lr_ratio=end / peak, b1=b1, b2=b2,
                                 weight_decay=wd, clip_norm=clip_norm, eps=eps)
  shapes = {"w": (3, 4), "b": (4,)}
  grads = _gradients(shapes, [0.0, 3.0, 0.1, 1.5])
  params = {"w": np.linspace(-1, 1, 12).reshape(3, 4).astype(np.float32),
            "b": np.linspace(0.5, 2, 4).astype(np.float32)}
  ours, _ = _run(tx, params, grads)
  # optax's warmup + cosine: 0 at step 0, the peak at step 1, cosine to `end` at 5.
  lrs = [0.0 if t == 0 else end + (peak - end) * 0.5 * (1 + np.cos(np.pi * (t - 1) / 4))
         for t in range(len(grads))]
  ref = _numpy_adamw(params, grads, lrs, b1, b2, eps, wd, clip_norm)
  for k in shapes:
    np.testing.assert_allclose(ours[k], ref[k], rtol=2e-5, atol=1e-6)


def test_adamw_wsd_defaults_are_openmoe2s_recipe():
  """REFERENCE.md's OpenMoE 2 recipe: lr 2e-4 -> 2e-5 by warmup-stable-decay (2000
  warmup steps, the last 10% decaying), betas (0.9, 0.95), weight decay 0.1,
  clipping at 1.0; eps 1e-8 as Adam's paper. The steps run in the stable phase (step
  5000 of 20000); one parameter's gradients are of the order of eps, where eps
  decides the step."""
  tx = optim.adamw_wsd(total_steps=20000)
  rates = [_run(tx, {"w": np.ones((2, 2), np.float32)}, [{"w": np.ones((2, 2))}],
                start_count=step)[1][0]
           for step in (0, 1000, 2000, 17999, 18000, 19000, 20000, 30000)]
  np.testing.assert_allclose(
      rates, [0.0, 1e-4, 2e-4, 2e-4, 2e-4, 1.1e-4, 2e-5, 2e-5], rtol=1e-5, atol=1e-12)
  shapes = {"w": (3, 4), "b": (4,), "tiny": (3,)}
  grads = _gradients(shapes, [3.0, 0.1, 1.5])
  for g in grads:  # global norms 11.0, 0.27 and 7.1; the tiny gradients ~1e-8
    g["tiny"] = g["tiny"] * np.float32(1e-8)
  params = {"w": np.linspace(-1, 1, 12).reshape(3, 4).astype(np.float32),
            "b": np.linspace(0.5, 2, 4).astype(np.float32),
            "tiny": np.zeros(3, np.float32)}
  ours, lrs = _run(tx, params, grads, start_count=5000)
  assert lrs == pytest.approx([2e-4] * 3)
  ref = _numpy_adamw(params, grads, [2e-4] * 3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1,
                     clip_norm=1.0)
  for k in shapes:  # the moves, ~6e-4, to 0.1% (float32 parameters near 1)
    np.testing.assert_allclose(np.asarray(ours[k], np.float64) - params[k],
                               ref[k] - params[k], rtol=1e-3, atol=1e-9)


def _numpy_adafactor(params, grads, lrs, decay_rate, threshold, min_dim):
  """Returns the parameters after Adafactor by the paper, as t5x configures it, in
  float64: second moments decaying with 1 - (t + 1)^-decay_rate, factored into row
  and column means for a matrix whose two dimensions reach min_dim (full otherwise),
  the update's RMS clipped at the threshold, scaled by the parameter's RMS (at least
  1e-3) and the learning rate lrs[t]."""
  eps1 = 1e-30
  ref = {k: v.astype(np.float64) for k, v in params.items()}
  factored = {k: v.ndim == 2 and min(v.shape) >= min_dim for k, v in params.items()}
  row = {k: np.zeros(v.shape[0]) for k, v in params.items() if factored[k]}
  col = {k: np.zeros(v.shape[1]) for k, v in params.items() if factored[k]}
  full = {k: np.zeros(v.shape) for k, v in params.items() if not factored[k]}
  for t, (g, lr) in enumerate(zip(grads, lrs)):
    beta = 1.0 - (t + 1.0) ** -decay_rate
    for k in params:
      g2 = g[k].astype(np.float64) ** 2 + eps1
      if factored[k]:
        row[k] = beta * row[k] + (1 - beta) * g2.mean(axis=1)
        col[k] = beta * col[k] + (1 - beta) * g2.mean(axis=0)
        v_hat = np.outer(row[k], col[k]) / row[k].mean()
      else:
        full[k] = v_hat = beta * full[k] + (1 - beta) * g2
      u = g[k] / np.sqrt(v_hat)
      clipped = u / max(1.0, np.sqrt(np.mean(u ** 2)) / threshold)
      scale = max(np.sqrt(np.mean(ref[k] ** 2)), 1e-3)
      ref[k] = ref[k] - lr * scale * clipped
  return ref


def test_adafactor_steps_equal_a_numpy_adafactor():
  decay_rate, threshold, lr0 = 0.5, 0.5, 0.05
  tx = optim.adafactor_openmoe(learning_rate=lr0, warmup_steps=1, decay_rate=decay_rate,
                               clipping_threshold=threshold, min_dim_size_to_factor=4)
  shapes = {"w": (4, 6), "b": (5,)}
  grads = _gradients(shapes, [1.0, 0.5, 2.0], seed=1)
  params = {"w": np.linspace(-2, 2, 24).reshape(4, 6).astype(np.float32),
            "b": np.full((5,), 1e-4, np.float32)}  # RMS below 1e-3: the floor applies
  ours, _ = _run(tx, params, grads)
  lrs = [lr0 * np.sqrt(1.0 / max(t, 1)) for t in range(len(grads))]
  ref = _numpy_adafactor(params, grads, lrs, decay_rate, threshold, min_dim=4)
  for k in shapes:
    np.testing.assert_allclose(ours[k], ref[k], rtol=2e-5, atol=1e-9)


def test_adafactor_openmoe_defaults_are_openmoes_t5x_settings():
  """REFERENCE.md: decay rate 0.8, lr 0.01 for 10k warmup steps, then 1/sqrt(step);
  t5x's Adafactor defaults: clipping at 1.0, factored from dimensions of 128, scaled
  by the parameter's RMS. A [128, 129] matrix is factored, a [127, 129] one not."""
  tx = optim.adafactor_openmoe()
  one = {"w": np.ones((2, 2), np.float32)}
  assert _run(tx, one, [one], start_count=40000)[1] == pytest.approx([0.005], rel=1e-6)
  shapes = {"w": (128, 129), "u": (127, 129), "b": (5,)}
  grads = _gradients(shapes, [1.0, 0.5, 2.0], seed=2)
  params = {k: np.linspace(-2, 2, np.prod(s)).reshape(s).astype(np.float32)
            for k, s in shapes.items()}
  ours, lrs = _run(tx, params, grads)
  assert lrs == pytest.approx([0.01] * 3)
  ref = _numpy_adafactor(params, grads, lrs, decay_rate=0.8, threshold=1.0, min_dim=128)
  for k in shapes:
    np.testing.assert_allclose(ours[k], ref[k], rtol=2e-5, atol=1e-6)
