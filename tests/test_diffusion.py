"""Masked diffusion: noise schedule, masking, loss weights, ELBO, a tiny run (the
sampler: test_diffusion_sampling.py)."""
import inspect
import math

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.model import Decoder
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.objectives import CausalLm, MaskedDiffusion, diffusion_elbo, is_diffusion
from openmoe_jax.objectives import diffusion as dl
from openmoe_jax.data.vocabulary import get_vocabulary, mask_token_id
from diffusion_stubs import (MASK, TINY, V, Calls, FixedLogits, batch_of, stub_params,
                             tiny_model)


@pytest.fixture(scope="module")
def tiny():
  return tiny_model()


def test_antithetic_times_cover_eps_to_one_evenly():
  eps, n = 1e-3, 1000
  t_b = np.sort(np.asarray(dl.antithetic_times(jax.random.PRNGKey(3), n, eps)))
  assert t_b.min() >= eps and t_b.max() < 1.0
  np.testing.assert_allclose(np.diff(t_b), (1 - eps) / n, rtol=1e-3)


def test_masking_rate_matches_t_and_skips_unscored_tokens():
  b, t = 32, 4000
  loss_bt = jnp.asarray(np.arange(t)[None] % 4 != 0).repeat(b, 0)
  t_b = dl.antithetic_times(jax.random.PRNGKey(0), b, 1e-3)
  masked_bt = np.asarray(dl.bernoulli_mask(jax.random.PRNGKey(1), loss_bt, t_b))
  assert not masked_bt[:, ::4].any()
  rate_b = masked_bt.sum(1) / (0.75 * t)
  sigma_b = np.sqrt(np.asarray(t_b) * (1 - np.asarray(t_b)) / (0.75 * t)) + 1e-3
  assert np.all(np.abs(rate_b - np.asarray(t_b)) < 5 * sigma_b)


def test_force_one_mask_and_exact_count_mask():
  loss_bt = jnp.asarray([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]], bool)
  tiny_t = jnp.full((3,), 1e-6)
  forced = np.asarray(dl.bernoulli_mask(jax.random.PRNGKey(0), loss_bt, tiny_t, True))
  assert list(forced.sum(1)) == [1, 0, 1] and not (forced & ~np.asarray(loss_bt)).any()
  free = np.asarray(dl.bernoulli_mask(jax.random.PRNGKey(0), loss_bt, tiny_t))
  assert not free.any()  # no forcing unless asked
  # 64 one-token rows: antithetic t spreads over [eps, 1), so about half draw no mask.
  one_token_rows = jnp.ones((64, 1), bool)
  drawn, _ = dl.draw_masks(jax.random.PRNGKey(0), one_token_rows, "mdlm", 1e-3)
  assert 16 < int(np.asarray(drawn).sum()) < 48
  forced, _ = dl.draw_masks(jax.random.PRNGKey(0), one_token_rows, "mdlm", 1e-3, True)
  assert np.asarray(forced).all()
  exact = np.asarray(dl.exact_count_mask(jax.random.PRNGKey(0), loss_bt,
                                         jnp.asarray([2, 1, 3])))
  assert list(exact.sum(1)) == [2, 0, 3] and not (exact & ~np.asarray(loss_bt)).any()


def test_random_truncation_cuts_loss_and_isolates_the_tail():
  loss_bt, seg_bt = jnp.ones((2, 50), bool), jnp.ones((2, 50), jnp.int32)
  cut_loss, cut_seg = dl.random_truncation(jax.random.PRNGKey(0), loss_bt, seg_bt, 1.0)
  n = int(np.asarray(cut_loss)[0].sum())
  assert 1 <= n <= 50 and np.asarray(cut_loss)[:, :n].all()
  np.testing.assert_array_equal(np.asarray(cut_seg), np.asarray(cut_loss).astype(int))
  same = dl.random_truncation(jax.random.PRNGKey(0), loss_bt, seg_bt, 0.0)
  np.testing.assert_array_equal(np.asarray(same[0]), np.asarray(loss_bt))


def test_is_diffusion_tells_the_objective_kind():
  assert is_diffusion(MaskedDiffusion(mask_id=MASK))
  assert not is_diffusion(CausalLm())
  assert not is_diffusion(CausalLm(attention_kind="prefix"))  # UL2
  assert not is_diffusion(None)  # a run without an objective trains causal LM


def test_model_sees_corrupted_targets_bidirectionally_and_predicts_its_own_token():
  batch, calls = batch_of(), Calls()
  batch["decoder_segment_ids"] = jnp.asarray([[1] * 8 + [2] * 8] * 4)  # packed pairs
  obj = MaskedDiffusion(mask_id=MASK, truncate_prob=0.0)
  own = FixedLogits(answer_bt=batch["decoder_target_tokens"], calls=calls)
  _, metrics = obj(own, stub_params(own), batch, jax.random.PRNGKey(4), train=True)
  tokens_bt, segment_ids_bt, kind, _ = calls.items[-1]
  tokens_bt = np.asarray(tokens_bt)
  targets_bt = np.asarray(batch["decoder_target_tokens"])
  masked_bt = tokens_bt == MASK
  assert kind == "bidirectional" and masked_bt.any()
  np.testing.assert_array_equal(tokens_bt[~masked_bt], targets_bt[~masked_bt])
  np.testing.assert_array_equal(np.asarray(segment_ids_bt),
                                np.asarray(batch["decoder_segment_ids"]))
  assert float(metrics["masked_accuracy"]) == 1.0 and float(metrics["ce_loss"]) < 1e-3
  shifted = FixedLogits(answer_bt=jnp.roll(batch["decoder_target_tokens"], -1, axis=1))
  _, metrics = obj(shifted, stub_params(shifted), batch, jax.random.PRNGKey(4),
                   train=True)
  assert float(metrics["masked_accuracy"]) < 0.2 and float(metrics["ce_loss"]) > 5.0
  # Without segment ids: one segment per row over the non-padding targets (id 0).
  unpacked = {k: v for k, v in batch.items() if k != "decoder_segment_ids"}
  unpacked["decoder_target_tokens"] = batch["decoder_target_tokens"].at[:, 13:].set(0)
  obj(own, stub_params(own), unpacked, jax.random.PRNGKey(4), train=True)
  np.testing.assert_array_equal(np.asarray(calls.items[-1][1]),
                                np.asarray([[1] * 13 + [0] * 3] * 4))


def test_random_truncation_keeps_a_uniform_length_in_1_to_t():
  """Over 4000 draws at t = 4: prob 1 keeps 1, 2, 3 or 4 tokens, each a quarter of
  the time (4.4 sigma bounds); prob 0.5 keeps all 4 in 0.5 + 0.5 / 4 of them."""
  keys = jax.random.split(jax.random.PRNGKey(1), 4000)
  loss_bt, seg_bt = jnp.ones((1, 4), bool), jnp.ones((1, 4), jnp.int32)
  kept = lambda prob: np.asarray(jax.vmap(lambda key: dl.random_truncation(
      key, loss_bt, seg_bt, prob)[0].sum())(keys))
  share_n = np.bincount(kept(1.0), minlength=5) / 4000
  assert share_n[0] == 0 and np.all(np.abs(share_n[1:] - 0.25) < 0.03), share_n
  assert abs(np.mean(kept(0.5) == 4) - 0.625) < 0.03


def test_llada_eval_masks_exactly_l_of_the_l_tokens_with_l_uniform():
  loss_bt = jnp.ones((12, 12), bool)  # 12 rows: antithetic l covers 1..12 once
  masked_bt, t_b = dl.draw_masks(jax.random.PRNGKey(2), loss_bt, "llada_eval", 0.5)
  count_b = np.asarray(masked_bt).sum(1)
  assert sorted(count_b.tolist()) == list(range(1, 13))
  np.testing.assert_allclose(np.asarray(t_b), count_b / 12, rtol=1e-6)
  np.testing.assert_allclose(
      np.asarray(dl.mask_weights("llada_eval", masked_bt, loss_bt, t_b)), 12 / count_b,
      rtol=1e-6)
  none_bt, _ = dl.draw_masks(jax.random.PRNGKey(2), jnp.zeros((2, 5), bool),
                             "llada_eval", 0.0)
  assert not np.asarray(none_bt).any()


def test_default_weighting_is_the_1_over_t_loss_and_llada_is_a_removed_name():
  obj = MaskedDiffusion(mask_id=MASK)
  assert obj.weighting == "mdlm" and not obj.force_one_mask
  assert obj.eps == 1e-3  # MDLM's: t ~ U(1e-3, 1) (REFERENCE.md)
  assert obj.truncate_prob == 0.01  # LLaDA: 1% of pretraining sequences cut short
  assert MaskedDiffusion(mask_id=MASK, eps=0.0).eps == 0.0
  for eps in (1.0, -0.1):
    with pytest.raises(ValueError, match=f"MaskedDiffusion.eps must be in \\[0, 1\\), "
                       f"got {eps}"):
      MaskedDiffusion(mask_id=MASK, eps=eps)
  with pytest.raises(ValueError, match="'llada' was removed; use 'mdlm'.*'llada_eval'"):
    MaskedDiffusion(mask_id=MASK, weighting="llada")
  with pytest.raises(ValueError, match="'llada' was removed"):
    diffusion_elbo(None, None, {}, jax.random.PRNGKey(0), 1, mask_id=MASK,
                   estimator="llada")
  with pytest.raises(ValueError, match="choose one of"):
    MaskedDiffusion(mask_id=MASK, weighting="exact")


@pytest.mark.parametrize("weighting", ["mdlm", "llada_eval"])
def test_loss_equals_a_numpy_computation_on_a_fixed_mask(monkeypatch, weighting):
  weights_bt = np.ones((2, 6), np.float32)
  weights_bt[1, 4:] = 0  # padding: never scored
  batch = batch_of(b=2, t=6, weights=weights_bt)
  masked_bt = np.asarray([[1, 0, 1, 0, 0, 1], [0, 1, 0, 0, 0, 0]], bool)
  t_b = np.asarray([0.4, 0.3], np.float32)  # "mdlm" weighs by 1/t; "llada_eval" by L/l
  monkeypatch.setattr(dl, "draw_masks", lambda *args, **kwargs: (
      jnp.asarray(masked_bt), jnp.asarray(t_b)))
  logits_btv = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (2, 6, V)))

  class Fixed(FixedLogits):
    @nn.compact
    def __call__(self, tokens_bt, **kwargs):
      return jnp.asarray(logits_btv) + self.param("bias", nn.initializers.zeros, (V,)), {
          "aux_loss": jnp.float32(0.25), "lb_loss": jnp.zeros(()), "z_loss": jnp.zeros(())}

  obj = MaskedDiffusion(mask_id=MASK, weighting=weighting, truncate_prob=0.0, z_loss=0.5)
  model = Fixed()
  loss, metrics = obj(model, stub_params(model), batch, jax.random.PRNGKey(5),
                      train=True)
  x_btv = logits_btv.astype(np.float64)
  x_btv = x_btv - x_btv.max(-1, keepdims=True)
  logp_btv = x_btv - np.log(np.exp(x_btv).sum(-1, keepdims=True))
  targets_bt = np.asarray(batch["decoder_target_tokens"])
  ce_bt = -np.take_along_axis(logp_btv, targets_bt[..., None], -1)[..., 0]
  loss_tokens_b, masked_b = weights_bt.sum(1), masked_bt.sum(1)  # L = [6, 4], l = [3, 1]
  weight_b = 1 / t_b.astype(np.float64) if weighting == "mdlm" else loss_tokens_b / masked_b
  expected = (weight_b[:, None] * masked_bt * ce_bt).sum() / loss_tokens_b.sum()
  # z-loss: the mean over masked tokens of logsumexp(logits)^2, weighted by z_loss.
  x_btv = logits_btv.astype(np.float64)
  lse_bt = np.log(np.exp(x_btv).sum(-1))
  z_loss = (lse_bt ** 2 * masked_bt).sum() / masked_bt.sum()
  np.testing.assert_allclose(float(metrics["logits_z_loss"]), z_loss, rtol=1e-5)
  # The loss adds the router losses (here 0.25) to the weighted CE and the z-loss.
  np.testing.assert_allclose(float(loss), expected + 0.5 * z_loss + 0.25, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["ce_loss"]), expected, rtol=1e-6)
  assert float(metrics["num_tokens"]) == 10
  np.testing.assert_allclose(float(metrics["mask_fraction"]), 4 / 10)


@pytest.mark.parametrize("weighting,force", [("mdlm", False), ("llada_eval", False)])
def test_uniform_model_expected_loss_is_log_v(weighting, force):
  model = FixedLogits()
  params, batch = stub_params(model), batch_of(b=8, t=64)
  obj = MaskedDiffusion(mask_id=MASK, weighting=weighting, force_one_mask=force)
  ce_loss = lambda r: obj(model, params, batch, r, train=True)[1]["ce_loss"]
  loss_fn = jax.jit(jax.vmap(ce_loss))
  losses = np.asarray(loss_fn(jax.random.split(jax.random.PRNGKey(0), 256)))
  assert abs(losses.mean() - math.log(V)) < 0.03 * math.log(V)
  if weighting == "llada_eval":  # sum of l CEs of log V times L/l: exact for every draw
    np.testing.assert_allclose(losses, math.log(V), rtol=1e-5)


@pytest.mark.parametrize("expert_choice", [False, True])
def test_gradients_flow_through_token_and_expert_choice_moe(tiny, expert_choice):
  model, params = tiny
  if expert_choice:  # no causality to break: a natural router for DLMs
    cfg = TINY.replace(moe=TINY.moe.replace(router=ExpertChoiceRouter(level="sequence")))
    model = Decoder(cfg)
    params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0),
                                          jnp.zeros((1, 16), jnp.int32)))["params"]
  obj, batch = MaskedDiffusion(mask_id=MASK), batch_of()
  grads, metrics = jax.jit(jax.grad(
      lambda p: obj(model, p, batch, jax.random.PRNGKey(1), train=True),
      has_aux=True))(params)
  norms = {jax.tree_util.keystr(k): float(jnp.linalg.norm(g))
           for k, g in jax.tree_util.tree_leaves_with_path(grads)}
  assert all(np.isfinite(v) for v in norms.values())
  assert norms["['head']"] > 0 and any(v > 0 for k, v in norms.items() if "moe" in k)
  assert "moe/aux_loss" in metrics and float(metrics["mask_fraction"]) > 0


def test_elbo_is_seeded_exact_for_uniform_and_its_error_shrinks(tiny):
  model, params = tiny
  batch = batch_of(b=2, t=16)
  a = diffusion_elbo(model, params, batch, jax.random.PRNGKey(0), 4, mask_id=MASK)
  b = diffusion_elbo(model, params, batch, jax.random.PRNGKey(0), 4, mask_id=MASK)
  assert a == b and np.isfinite(a["nelbo"])
  many = diffusion_elbo(model, params, batch, jax.random.PRNGKey(0), 32, mask_id=MASK)
  assert many["stderr"] < a["stderr"]
  np.testing.assert_allclose(many["perplexity_bound"], math.exp(many["nelbo"]))
  stub = FixedLogits()
  uniform = diffusion_elbo(stub, stub_params(stub), batch, jax.random.PRNGKey(1), 3,
                           mask_id=MASK)
  np.testing.assert_allclose(uniform["nelbo"], math.log(V), rtol=1e-6)
  mdlm = diffusion_elbo(stub, stub_params(stub), batch_of(b=8, t=64),
                        jax.random.PRNGKey(1), 64, mask_id=MASK, estimator="mdlm")
  assert abs(mdlm["nelbo"] - math.log(V)) < 4 * mdlm["stderr"] + 0.02


def test_gin_file_builds_the_objective_with_the_vocabulary_mask():
  gin_utils.import_configurables()
  gin_utils.parse_gin(["objectives/masked_diffusion.gin"], finalize=False)
  objective = MaskedDiffusion()
  assert gin.query_parameter("train.objective").selector == "MaskedDiffusion"
  assert objective.mask_id == mask_token_id(get_vocabulary()) == 6
  assert objective.weighting == "mdlm" and not objective.force_one_mask


_TINY_BINDINGS = [  # as tests/test_train.py
    "ModelConfig.d_model = 32", "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 16",
    "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 2", "MoeConfig.num_experts = 4",
    "MoeConfig.group_size = 64", "SEQUENCE_LENGTH = 64", "BATCH_SIZE = 8",
    "train.eval_batches = 2", "train.log_every_steps = 1",
]


@pytest.mark.slow
def test_three_step_quickstart_run_with_diffusion(tmp_path):
  from openmoe_jax.trainer import train  # pylint: disable=g-import-not-at-top
  gin_utils.import_configurables()
  gin_utils.parse_gin(
      ["runs/quickstart.gin", "objectives/masked_diffusion.gin"],
      _TINY_BINDINGS + [f"MODEL_DIR = '{tmp_path}'", "TRAIN_STEPS = 3",
                       "adamw_warmup_cosine.warmup_steps = 1", "SEQUENCE_LENGTH = 32",
                       "MoeConfig.group_size = 32", "train.eval_batches = 1"])
  lines = []
  summary = train(print_fn=lines.append)
  assert summary["final_step"] == 3
  assert np.isfinite([summary["first_eval_loss"], summary["last_eval_loss"]]).all()
  assert any("eval @ step 3" in line for line in lines)


def test_only_training_batches_are_truncated():
  """truncate_prob 1: a training batch is cut (15 times in 16 to fewer than its 16
  positions; this key does), an evaluation batch never is."""
  model, batch = FixedLogits(), batch_of(b=4, t=16)
  obj = MaskedDiffusion(mask_id=MASK, truncate_prob=1.0)
  _, train_metrics = obj(model, stub_params(model), batch, jax.random.PRNGKey(3),
                         train=True)
  _, eval_metrics = obj(model, stub_params(model), batch, jax.random.PRNGKey(3),
                        train=False)
  assert float(train_metrics["num_tokens"]) < 64 == float(eval_metrics["num_tokens"])


def test_elbo_scores_loss_tokens_only_and_takes_a_single_sample():
  """Uniform predictions: LLaDA's estimator gives exactly log V whatever is masked;
  the padding (weight 0) is never a loss token; one sample has no standard error."""
  model = FixedLogits()
  weights = np.ones((2, 8), np.float32)
  weights[1, 5:] = 0
  batch = batch_of(b=2, t=8, weights=weights)
  one = diffusion_elbo(model, stub_params(model), batch, jax.random.PRNGKey(0), 1,
                       mask_id=MASK)
  assert one["num_tokens"] == 13 and math.isnan(one["stderr"])
  assert one["nelbo"] == pytest.approx(math.log(V), rel=1e-5)
  two = diffusion_elbo(model, stub_params(model), batch, jax.random.PRNGKey(0), 2,
                       mask_id=MASK)
  assert two["stderr"] == pytest.approx(0.0, abs=1e-6)  # each sample is log V
  with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
    diffusion_elbo(model, stub_params(model), batch, jax.random.PRNGKey(0), 0,
                   mask_id=MASK)
  # The bound's default eps (for "mdlm" draws) is the training objective's.
  assert inspect.signature(diffusion_elbo).parameters["eps"].default == (
      MaskedDiffusion().eps)


def test_the_bound_runs_the_model_as_in_evaluation():
  """No router jitter, the evaluation capacity factor: train=False for the ELBO, as
  for the objective's own evaluation; train=True only for a training step."""
  calls = Calls()
  model, batch = FixedLogits(calls=calls), batch_of(b=2, t=8)
  diffusion_elbo(model, stub_params(model), batch, jax.random.PRNGKey(0), 2,
                 mask_id=MASK)
  MaskedDiffusion(mask_id=MASK)(model, stub_params(model), batch,
                                jax.random.PRNGKey(0), train=True)
  assert [train for *_, train in calls.items] == [False, True]


def test_a_batch_with_one_loss_token_scores_it_alone_at_t_1():
  # Row 0 scores one token, row 1 none (all padding). llada_eval masks l ~ U{1..L}
  # of L = 1 token: that token, t = l / L = 1, weight L / l = 1; an empty row gets
  # t = 1 too (one token of none). A uniform model's CE on the token is log V, its
  # logsumexp log V; every mean is over that one token (no guard of 1 shows through).
  weights_bt = np.zeros((2, 8), np.float32)
  weights_bt[0, 5] = 1
  model = FixedLogits()
  obj = MaskedDiffusion(mask_id=MASK, weighting="llada_eval", truncate_prob=0.0)
  _, metrics = obj(model, stub_params(model), batch_of(b=2, t=8, weights=weights_bt),
                   jax.random.PRNGKey(3), train=True)
  m = {k: float(v) for k, v in metrics.items()}
  assert m["num_tokens"] == 1 and m["mask_fraction"] == 1 and m["mean_t"] == 1
  np.testing.assert_allclose(m["ce_loss"], math.log(V), rtol=1e-6)
  np.testing.assert_allclose(m["logits_z_loss"], math.log(V) ** 2, rtol=1e-6)
  bound = diffusion_elbo(model, stub_params(model), batch_of(b=2, t=8, weights=weights_bt),
                         jax.random.PRNGKey(4), 2, mask_id=MASK)
  assert bound["num_tokens"] == 1
  np.testing.assert_allclose(bound["nelbo"], math.log(V), rtol=1e-6)
