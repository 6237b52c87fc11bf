"""CausalLm: the loss against an independent NumPy computation (T5X semantics), and
its MoE drop metrics against the sown routing.

T5X `compute_weighted_cross_entropy` with loss_normalizing_factor
NUM_REAL_TARGET_TOKENS: sum over tokens of w x (CE + z x logsumexp^2), divided by
sum(w). Ours clamps the divisor at 1, which only matters when sum(w) < 1 (an
all-padding batch gives 0 here, 0/0 in T5X).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.analysis.routing import flatten_routing
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
from openmoe_jax.objectives import CausalLm
from openmoe_jax.objectives.common import moe_layer_numbers, weighted_cross_entropy

CFG = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                  num_layers=2, sparse_interval=2,
                  moe=MoeConfig(num_experts=4, group_size=8, min_capacity=1,
                                router_init_std=1.0))


def _np_weighted_loss(logits_btv, targets_bt, weights_bt, z_loss):
  """Returns (CE, logits z-loss, accuracy) averaged over weighted tokens, float64."""
  logits = np.asarray(logits_btv, np.float64)
  peak = logits.max(-1, keepdims=True)
  lse_bt = np.log(np.exp(logits - peak).sum(-1)) + peak[..., 0]
  target_logit_bt = np.take_along_axis(logits, targets_bt[..., None], -1)[..., 0]
  total = weights_bt.sum()
  ce = np.sum(weights_bt * (lse_bt - target_logit_bt)) / total
  zl = np.sum(weights_bt * lse_bt ** 2) / total
  accuracy = np.sum(weights_bt * (logits.argmax(-1) == targets_bt)) / total
  return ce, zl, accuracy


@pytest.mark.parametrize("z_loss", [1e-4, 0.05])
def test_causal_lm_loss_matches_numpy(z_loss):
  rng = np.random.default_rng(0)
  inputs = rng.integers(0, CFG.vocab_size, (2, 8))
  targets = rng.integers(0, CFG.vocab_size, (2, 8))  # unrelated to the inputs
  weights = np.ones((2, 8)) * rng.choice([0.0, 0.5, 1.0, 2.0], (2, 8))
  weights[0, :3] = 0.0  # padding-like
  batch = {"decoder_input_tokens": jnp.asarray(inputs),
           "decoder_target_tokens": jnp.asarray(targets),
           "decoder_loss_weights": jnp.asarray(weights, jnp.float32)}
  model = Decoder(CFG)
  tokens = batch["decoder_input_tokens"]
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), tokens))
  logits, aux = jax.jit(lambda p: model.apply(p, tokens, train=True))(params)
  objective = CausalLm(z_loss=z_loss)
  run = jax.jit(lambda p, b: objective(model, p["params"], b, jax.random.PRNGKey(0),
                                       train=True))
  loss, metrics = run(params, batch)
  ce, zl, accuracy = _np_weighted_loss(logits, targets, weights, z_loss)
  expected = ce + z_loss * zl + float(aux["aux_loss"])
  assert float(metrics["ce_loss"]) == pytest.approx(ce, rel=1e-5)
  assert float(metrics["logits_z_loss"]) == pytest.approx(zl, rel=1e-5)
  assert float(metrics["accuracy"]) == pytest.approx(accuracy, rel=1e-6, abs=1e-7)
  assert float(metrics["num_tokens"]) == pytest.approx(weights.sum())
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  assert float(metrics["loss"]) == float(loss)
  assert float(aux["aux_loss"]) > 1e-3 and z_loss * zl > 1e-4 * ce  # terms matter
  # An all-padding batch: 0, not 0/0 (T5X would give NaN).
  empty = dict(batch, decoder_loss_weights=jnp.zeros((2, 8), jnp.float32))
  _, metrics = run(params, empty)
  assert float(metrics["ce_loss"]) == 0.0 and float(metrics["logits_z_loss"]) == 0.0


def test_causal_lm_reports_drops_by_quarter_from_the_routing():
  """moe/drop_fraction_{first,last}_quarter (mean and per layer) against a direct
  count of the routing the MoE layers sow."""
  cfg = CFG.replace(num_layers=4, moe=CFG.moe.replace(capacity_factor_train=0.5))
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 16), 0, cfg.vocab_size)
  batch = {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
           "decoder_loss_weights": jnp.ones((2, 16), jnp.float32)}
  model = Decoder(cfg)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), tokens))
  _, metrics = jax.jit(lambda p: CausalLm()(model, p["params"], batch,
                                            jax.random.PRNGKey(0), train=True))(params)
  _, state = jax.jit(lambda p: model.apply(p, tokens, train=True,
                                           mutable=["intermediates"]))(params)
  kept_lbtk = np.asarray(flatten_routing(state["intermediates"], cfg)["kept"])
  assert kept_lbtk.shape == (2, 2, 16, 2)
  for part, sl in (("first", slice(0, 4)), ("last", slice(12, 16))):
    dropped_l = 1 - kept_lbtk[:, :, sl].mean(axis=(1, 2, 3))
    assert float(metrics[f"moe/drop_fraction_{part}_quarter"]) == pytest.approx(
        dropped_l.mean())
    # Per-layer names carry the model layer number (MoE layers 1 and 3 here).
    for l, n in enumerate(moe_layer_numbers(model)):
      assert float(metrics[f"moe/layer_{n}/drop_fraction_{part}_quarter"]) == (
          pytest.approx(dropped_l[l]))
  assert 0 < float(metrics["moe/drop_fraction"]) < 1


def test_weighted_cross_entropy_matches_numpy_with_its_gradient():
  """The fused CE / z-loss / accuracy pass against the float64 NumPy reference, on
  logits where about half the targets are the argmax (so accuracy is informative),
  and d loss / d logits against the closed form w / N x ((1 + 2 z lse) softmax -
  onehot)."""
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((3, 5, 11)).astype(np.float32) * 3
  targets = np.where(rng.random((3, 5)) < 0.5, logits.argmax(-1),
                     rng.integers(0, 11, (3, 5))).astype(np.int32)
  weights = rng.choice([0.0, 0.5, 1.0, 2.0], (3, 5))
  z = 0.05
  loss_fn = lambda lg: weighted_cross_entropy(lg, jnp.asarray(targets),
                                              jnp.asarray(weights, jnp.float32), z)
  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(logits))
  ce, zl, accuracy = _np_weighted_loss(logits, targets, weights, z)
  assert 0.2 < accuracy < 0.9
  assert float(metrics["accuracy"]) == pytest.approx(accuracy, rel=1e-6)
  assert float(metrics["ce_loss"]) == pytest.approx(ce, rel=1e-5)
  assert float(metrics["logits_z_loss"]) == pytest.approx(zl, rel=1e-5)
  assert float(loss) == pytest.approx(ce + z * zl, rel=1e-5)
  x = logits.astype(np.float64)
  lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
  softmax = np.exp(x - lse[..., None])
  onehot = np.eye(11)[targets]
  expected = (weights / weights.sum())[..., None] * (
      (1 + 2 * z * lse)[..., None] * softmax - onehot)
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-6)
  default, _ = weighted_cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                      jnp.asarray(weights, jnp.float32))
  assert float(default) == pytest.approx(ce, rel=1e-5)  # no z-loss unless asked


def test_accuracy_counts_a_tie_for_the_largest_logit_as_wrong():
  """A target whose logit is the unique largest is correct; one tied with another
  index for the largest (before or after it) is not, whatever argmax would pick."""
  logits = jnp.asarray([[[0.0, 2.0, 1.0, 2.0],    # target 1 ties index 3
                         [0.0, 2.0, 1.0, 2.0],    # target 3 ties index 1
                         [0.0, 2.0, 1.0, 0.5],    # target 1 unique max
                         [3.0, 3.0, 3.0, 3.0]]])  # all equal
  targets = jnp.asarray([[1, 3, 1, 2]])
  for row, expected in enumerate([0.0, 0.0, 1.0, 0.0]):
    weights = jnp.zeros((1, 4)).at[0, row].set(1.0)
    _, metrics = weighted_cross_entropy(logits, targets, weights)
    assert float(metrics["accuracy"]) == expected, row


def test_packed_batch_loss_equals_the_documents_run_one_by_one():
  """A packed row (two documents and padding): CausalLm must hand the segment ids to
  the model, so its CE equals NumPy's CE on each document's logits run alone. Dense
  layers: MoE capacity would couple the documents through their shared group."""
  cfg = CFG.replace(sparse_interval=0)
  model = Decoder(cfg)
  rng = np.random.default_rng(5)
  inputs = rng.integers(1, cfg.vocab_size, (1, 12))
  targets = rng.integers(1, cfg.vocab_size, (1, 12))
  seg = np.array([[1] * 5 + [2] * 5 + [0] * 2])
  pos = np.array([list(range(5)) + list(range(5)) + [0, 0]])
  weights = (seg > 0).astype(np.float32)
  batch = {"decoder_input_tokens": jnp.asarray(inputs),
           "decoder_target_tokens": jnp.asarray(targets),
           "decoder_loss_weights": jnp.asarray(weights),
           "decoder_segment_ids": jnp.asarray(seg), "decoder_positions": jnp.asarray(pos)}
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), batch["decoder_input_tokens"]))
  _, metrics = jax.jit(lambda p, b: CausalLm(z_loss=0.0)(
      model, p["params"], b, jax.random.PRNGKey(0), train=False))(params, batch)
  alone = [np.asarray(model.apply(params, jnp.asarray(inputs[:, a:b]))[0])
           for a, b in ((0, 5), (5, 10))]
  ce, _, _ = _np_weighted_loss(np.concatenate(alone, axis=1), targets[:, :10],
                               np.ones((1, 10)), 0.0)
  assert float(metrics["num_tokens"]) == 10
  assert float(metrics["ce_loss"]) == pytest.approx(ce, rel=1e-5)
