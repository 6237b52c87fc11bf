"""Train step pieces: exact gradient accumulation over microbatches, multi-host
detection, the stage schedule, Adam moments' placement and evaluation weighting."""
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from openmoe_jax import trainer as trainer_lib
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
from openmoe_jax.objectives import CausalLm
from openmoe_jax.trainer import TrainState, make_train_step

CFG = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                  num_layers=2, sparse_interval=2,
                  moe=MoeConfig(num_experts=4, group_size=16, capacity_factor_train=1.0,
                                min_capacity=1))


def _batch(b=8, t=16):
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, size=(b, t)).astype(np.int32)
  # Unequal target-token counts per row, so slices carry different weights.
  weights = (rng.random((b, t)) < np.linspace(0.2, 1.0, b)[:, None]).astype(np.int32)
  return {"decoder_input_tokens": tokens, "decoder_target_tokens": np.roll(tokens, -1, 1),
          "decoder_loss_weights": weights,
          "decoder_segment_ids": np.ones((b, t), np.int32),
          "decoder_positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))}


def _init_params(model, batch):
  return nn.unbox(model.init(jax.random.PRNGKey(0), batch["decoder_input_tokens"])
                  )["params"]


def test_microbatched_step_equals_full_batch_step():
  model = Decoder(CFG)
  optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  batch = jax.tree.map(jnp.asarray, _batch())
  params = _init_params(model, batch)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  results = {}
  for k in (1, 2, 4):
    step = jax.jit(make_train_step(model, CausalLm(), optimizer, microbatches=k))
    results[k] = step(state, batch, jax.random.PRNGKey(1))
  full_state, full_metrics = results[1]
  for k in (2, 4):
    new_state, metrics = results[k]
    assert float(metrics["loss"]) == pytest.approx(float(full_metrics["loss"]), rel=1e-5)
    assert float(metrics["num_tokens"]) == float(full_metrics["num_tokens"])
    assert float(metrics["grad_norm"]) == pytest.approx(
        float(full_metrics["grad_norm"]), rel=1e-4)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(full_state.params)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert float(full_metrics["grad_norm"]) > 0


def _one_loss_token(batch):
  weights = np.zeros_like(batch["decoder_loss_weights"])
  weights[3, 5] = 1
  return dict(batch, decoder_loss_weights=weights)


@pytest.mark.parametrize("make_batch", [_batch, lambda: _one_loss_token(_batch())],
                         ids=["batch", "one_loss_token"])
def test_a_step_descends_the_objectives_training_loss(make_batch):
  """SGD at learning rate 1: the step's new parameters are the old ones minus the
  gradient of the objective's loss in training mode (the training capacity factor,
  1.0 here against 2.0 in evaluation, drops tokens), router losses included."""
  model, objective = Decoder(CFG), CausalLm()
  optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
  batch = jax.tree.map(jnp.asarray, make_batch())
  params = _init_params(model, batch)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  new_state, metrics = jax.jit(make_train_step(model, objective, optimizer))(
      state, batch, jax.random.PRNGKey(1))

  def loss(p, train):
    return objective(model, p, batch, jax.random.PRNGKey(2), train=train)[0]
  expected_loss, grads = jax.value_and_grad(loss)(params, True)
  assert float(metrics["loss"]) == pytest.approx(float(expected_loss), rel=1e-6)
  assert float(metrics["moe/drop_fraction"]) > 0.05
  assert abs(float(loss(params, False)) - float(expected_loss)) > 1e-3
  assert float(metrics["moe/aux_loss"]) > 1e-3  # the router losses are in the gradient
  for new, old, grad in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(params),
                            jax.tree.leaves(grads)):
    np.testing.assert_allclose(new, old - grad, rtol=1e-5, atol=1e-7)


def test_the_eval_step_routes_with_the_evaluation_capacity_factor():
  """make_eval_step's metrics are the objective's with train=False (capacity factor
  2.0), not the training step's (1.0: more tokens drop)."""
  model, objective = Decoder(CFG), CausalLm()
  batch = jax.tree.map(jnp.asarray, _batch())
  params = _init_params(model, batch)
  got = jax.jit(trainer_lib.make_eval_step(model, objective))(params, batch)
  evaluation, training = (
      objective(model, params, batch, jax.random.PRNGKey(3), train=train)[1]
      for train in (False, True))
  assert float(training["moe/drop_fraction"]) > float(
      evaluation["moe/drop_fraction"]) + 0.05
  for key in ("ce_loss", "moe/drop_fraction"):
    assert float(got[key]) == pytest.approx(float(evaluation[key]), rel=1e-6), key


@pytest.mark.parametrize("hosts,expected", [
    ("", False), ("10.0.0.2", False), ("10.0.0.2,10.0.0.3", True),
    ("WARNING: could not determine TPU worker hostnames or IP addresses, please set",
     False)])
def test_multi_host_detection(monkeypatch, hosts, expected):
  from openmoe_jax import distributed  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda: calls.append(1))
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", hosts)
  monkeypatch.delenv("MEGASCALE_COORDINATOR_ADDRESS", raising=False)
  assert distributed.maybe_initialize_distributed(None) is expected
  assert len(calls) == int(expected)
  assert distributed.maybe_initialize_distributed(False) is False


def test_stage_index_follows_the_schedule():
  from openmoe_jax.trainer import Stage, stage_index  # pylint: disable=g-import-not-at-top
  stages = (Stage(0, "a"), Stage(3, "b"), Stage(5, "c"))
  assert [stage_index(stages, s) for s in range(0, 8)] == [0, 0, 0, 0, 1, 1, 2, 2]
  # A stage from step 1 on runs step 2 onwards: step 1 is the first stage's.
  assert [stage_index((Stage(0, "a"), Stage(1, "b")), s) for s in range(4)] == [
      0, 0, 1, 1]


def _stage_batches(trained_batches, steps, steps_before_data=0):
  """Returns the batch each of `steps` trains on when the run resumes after
  `trained_batches` batches of its data (drawn by the steps after
  `steps_before_data`), over three stages of labelled fake batches: (stage name,
  data seed, index of the batch in the stage's stream)."""
  from openmoe_jax.trainer import Stage, _stage_schedule  # pylint: disable=g-import-not-at-top

  def host_passes(name, *, seed=None, skip_batches=0, split="train", **kwargs):
    del kwargs
    if split != "train":
      return lambda: iter(())
    return lambda: ((name, seed, i) for i in itertools.count(skip_batches))

  class _Trainer:
    objective = CausalLm()

  stages = (Stage(0, "a"), Stage(3, "b"), Stage(5, "c"))
  schedule = _stage_schedule(_Trainer(), stages, host_passes, rng=None, seed=10,
                             trained_batches=trained_batches, eval_split="validation",
                             eval_batches=1, print_fn=lambda *_: None,
                             steps_before_data=steps_before_data)
  return [next(schedule(step).batches) for step in steps]


def test_a_resumed_run_trains_on_the_batches_an_uninterrupted_one_would():
  full = _stage_batches(0, range(1, 9))
  assert full == [("a", 10, 0), ("a", 10, 1), ("a", 10, 2), ("b", 11, 0),
                  ("b", 11, 1), ("c", 12, 0), ("c", 12, 1), ("c", 12, 2)]
  for trained in range(1, 8):  # resumed after each step, in and between stages
    assert _stage_batches(trained, range(trained + 1, 9)) == full[trained:], trained


@pytest.mark.parametrize("export_step,expected", [
    (2, [("a", 10, 0), ("b", 11, 0), ("b", 11, 1), ("c", 12, 0), ("c", 12, 1),
         ("c", 12, 2)]),
    (4, [("b", 11, 0), ("c", 12, 0), ("c", 12, 1), ("c", 12, 2)])])
def test_a_run_from_a_params_export_resumes_on_the_batches_it_would_have_drawn(
    export_step, expected):
  # Started at the export's step with no batch drawn: each stage's stream from its
  # own first batch (stage "b" runs steps 4-5, "c" steps 6-8).
  full = _stage_batches(0, range(export_step + 1, 9), steps_before_data=export_step)
  assert full == expected
  for step in range(export_step + 1, 8):  # resumed after each step
    drawn = step - export_step
    assert _stage_batches(drawn, range(step + 1, 9), export_step) == full[drawn:], step


def test_trainer_places_adam_moments_like_their_parameters():
  from openmoe_jax import partitioning  # pylint: disable=g-import-not-at-top
  from openmoe_jax.trainer import Trainer  # pylint: disable=g-import-not-at-top
  mesh = partitioning.make_mesh(data=2, fsdp=2, tensor=2)
  with partitioning.activate(mesh):
    trainer = Trainer(Decoder(CFG), CausalLm(),
                      optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), mesh,
                      sequence_length=16)
    state = trainer.init_state(jax.random.PRNGKey(0))
    adam = _adam_state(state.opt_state)
    param_sh = jax.tree.map(lambda a: a.sharding, state.params)
    assert jax.tree.map(lambda a: a.sharding, adam.mu) == param_sh
    assert jax.tree.map(lambda a: a.sharding, adam.nu) == param_sh
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(param_sh))
    state, metrics = trainer.train_step(state, _batch(), jax.random.PRNGKey(1))
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
    assert jax.tree.map(lambda a: a.sharding, _adam_state(state.opt_state).mu) == param_sh
    # One batch's eval step is what the evaluation over that one batch reports.
    one = {k: float(v) for k, v in trainer.eval_step(state.params, _batch()).items()}
    assert trainer.evaluate(state.params, iter([_batch()])) == pytest.approx(one)
    assert one["num_tokens"] == _batch()["decoder_loss_weights"].sum()


def _adam_state(opt_state):
  """Returns the ScaleByAdamState inside `opt_state`."""
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  return next(x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x))


def test_evaluation_weights_each_batch_by_its_target_tokens():
  # Eval batches carry different numbers of real target tokens (the last one of a
  # split is mostly padding): each metric is the token-weighted mean, not the mean
  # of the batches' means.
  per_batch = [{"ce_loss": 1.0, "accuracy": 0.5, "num_tokens": 10.0},
               {"ce_loss": 4.0, "accuracy": 0.9, "num_tokens": 30.0},
               {"ce_loss": 9.0, "accuracy": 0.1, "num_tokens": 0.0}]
  result = trainer_lib.evaluate(lambda params, batch: per_batch[batch], None,
                               iter(range(3)), to_device=lambda batch: batch)
  assert result["ce_loss"] == pytest.approx((1.0 * 10 + 4.0 * 30) / 40)
  assert result["accuracy"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)
  assert result["num_tokens"] == 40.0
  with pytest.raises(ValueError, match="no target tokens"):
    trainer_lib.evaluate(lambda params, batch: per_batch[2], None, iter([2]),
                         lambda batch: batch)
