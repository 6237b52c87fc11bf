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
  state = tx.init(jax.tree.map(jnp.asarray, params))
  ours = jax.tree.map(jnp.asarray, params)
  ref = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: np.zeros(s) for k, s in shapes.items()}
  v = {k: np.zeros(s) for k, s in shapes.items()}
  for t, g in enumerate(grads):
    updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, ours)
    ours = optax.apply_updates(ours, updates)
    # optax's warmup + cosine: 0 at step 0, the peak at step 1, cosine to `end` at 5.
    lr = 0.0 if t == 0 else end + (peak - end) * 0.5 * (1 + np.cos(np.pi * (t - 1) / 4))
    norm = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in g.values()))
    clip = min(1.0, clip_norm / norm) if clip_norm and norm > 0 else 1.0
    for k in shapes:
      gk = g[k] * clip
      m[k] = b1 * m[k] + (1 - b1) * gk
      v[k] = b2 * v[k] + (1 - b2) * gk ** 2
      step = (m[k] / (1 - b1 ** (t + 1))) / (np.sqrt(v[k] / (1 - b2 ** (t + 1))) + eps)
      decay = wd * ref[k] if ref[k].ndim > 1 else 0.0
      ref[k] = ref[k] - lr * (step + decay)
  for k in shapes:
    np.testing.assert_allclose(ours[k], ref[k], rtol=2e-5, atol=1e-6)


def test_adafactor_steps_equal_a_numpy_adafactor():
  """Adafactor by the paper, as t5x configures it: second moments decaying with
  1 - (t + 1)^-decay_rate, factored into row and column means for a matrix whose
  two dimensions reach min_dim_size_to_factor (full for a vector), the update's RMS
  clipped at the threshold, scaled by the parameter's RMS (at least 1e-3) and the
  rsqrt learning rate."""
  decay_rate, threshold, lr0, eps1 = 0.5, 0.5, 0.05, 1e-30
  tx = optim.adafactor_openmoe(learning_rate=lr0, warmup_steps=1, decay_rate=decay_rate,
                               clipping_threshold=threshold, min_dim_size_to_factor=4)
  shapes = {"w": (4, 6), "b": (5,)}
  grads = _gradients(shapes, [1.0, 0.5, 2.0], seed=1)
  params = {"w": np.linspace(-2, 2, 24).reshape(4, 6).astype(np.float32),
            "b": np.full((5,), 1e-4, np.float32)}  # RMS below 1e-3: the floor applies
  state = tx.init(jax.tree.map(jnp.asarray, params))
  ours = jax.tree.map(jnp.asarray, params)
  ref = {k: v.astype(np.float64) for k, v in params.items()}
  row, col, full = np.zeros(4), np.zeros(6), np.zeros(5)
  for t, g in enumerate(grads):
    updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, ours)
    ours = optax.apply_updates(ours, updates)
    beta = 1.0 - (t + 1.0) ** -decay_rate
    lr = lr0 * np.sqrt(1.0 / max(t, 1))
    g2_w, g2_b = g["w"].astype(np.float64) ** 2 + eps1, g["b"].astype(np.float64) ** 2 + eps1
    row = beta * row + (1 - beta) * g2_w.mean(axis=1)
    col = beta * col + (1 - beta) * g2_w.mean(axis=0)
    full = beta * full + (1 - beta) * g2_b
    v_hat = np.outer(row, col) / row.mean()
    u = {"w": g["w"] / np.sqrt(v_hat), "b": g["b"] / np.sqrt(full)}
    for k in shapes:
      clipped = u[k] / max(1.0, np.sqrt(np.mean(u[k] ** 2)) / threshold)
      scale = max(np.sqrt(np.mean(ref[k] ** 2)), 1e-3)
      ref[k] = ref[k] - lr * scale * clipped
  for k in shapes:
    np.testing.assert_allclose(ours[k], ref[k], rtol=2e-5, atol=1e-9)
