"""Sort, ragged and block dispatchers against the einsum dispatcher through the MoE
layer."""
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
from openmoe_jax.moe.dispatch import (AutoDispatcher, BlockDispatcher, EinsumDispatcher,
                                      RaggedDispatcher, SortDispatcher)
from openmoe_jax.moe.dispatch import block
from openmoe_jax.moe.layer import MoeLayer, dispatcher_of
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter

B, T, D, D_FF = 2, 16, 8, 12


def _outputs_and_grads(cfg, dispatcher, params, x_btd, ct_btd):
  """Returns (y, aux, d params, d x) of the layer with `dispatcher`."""
  layer = MoeLayer(cfg.replace(dispatcher=dispatcher), "swiglu", D_FF)

  def loss(p, x):
    y_btd, aux = layer.apply(p, x, train=True)
    return jnp.sum(y_btd * ct_btd), (y_btd, aux)

  (_, (y_btd, aux)), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
      params, x_btd)
  return y_btd, aux, grads[0], grads[1]


def _compare(cfg, engines, reference_cfg=None, seed=0):
  """Asserts each of `engines` == einsum (on `reference_cfg`, default cfg): y and
  grads. Returns (each engine's aux, the reference's aux)."""
  x_btd = jax.random.normal(jax.random.PRNGKey(seed), (B, T, D))
  ct_btd = jax.random.normal(jax.random.PRNGKey(seed + 7), (B, T, D))
  init = jax.jit(MoeLayer(cfg, "swiglu", D_FF).init, static_argnames="train")
  params = nn.unbox(init(jax.random.PRNGKey(seed + 1), x_btd, train=True))
  want = _outputs_and_grads(reference_cfg or cfg, EinsumDispatcher(), params, x_btd,
                            ct_btd)
  auxes = []
  for engine in engines:
    got = _outputs_and_grads(cfg, engine, params, x_btd, ct_btd)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6, err_msg=repr(engine))
    for a, b in zip(jax.tree.leaves((got[2], got[3])),
                    jax.tree.leaves((want[2], want[3]))):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=repr(engine))
    auxes.append(got[1])
  return auxes, want[1]


TOKEN_CASES = [  # (experts, top_k, capacity factor)
    (4, 1, 0.5), (4, 2, 1.0), (4, 3, 0.25), (16, 2, 1.25), (16, 3, 0.5), (16, 1, 2.0)]


# The block dispatcher with its default chunks (one 128-row chunk runs past every
# expert) and with chunks of 4 / 1 rows (all remainder sizes). Each test compares
# all of them with one einsum reference.
CAPACITY_ENGINES = [SortDispatcher(), BlockDispatcher(), BlockDispatcher(big=4, small=1)]
DROPLESS_ENGINES = [RaggedDispatcher("padded", tile=4),
                    RaggedDispatcher("ragged_dot", tile=4), BlockDispatcher(),
                    BlockDispatcher(big=4, small=2)]


@pytest.mark.parametrize("num_experts,top_k,cf", TOKEN_CASES)
def test_sort_and_block_equal_einsum_token_choice(num_experts, top_k, cf):
  cfg = MoeConfig(num_experts=num_experts, top_k=top_k, group_size=16,
                  capacity_factor_train=cf, min_capacity=1, router_init_std=2.0)
  auxes, _ = _compare(cfg, CAPACITY_ENGINES, seed=num_experts + top_k)
  if cf <= 0.5:
    assert all(float(aux["drop_fraction"]) > 0.3 for aux in auxes), "heavy overflow"


@pytest.mark.parametrize("level", ["batch", "sequence"])
def test_sort_and_block_equal_einsum_expert_choice(level):
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=32, capacity_factor_train=1.0,
                  router=ExpertChoiceRouter(level=level), router_init_std=2.0)
  _compare(cfg, CAPACITY_ENGINES)


@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (16, 3), (4, 1)])
def test_ragged_and_block_equal_dropless_einsum(num_experts, top_k):
  cfg = MoeConfig(num_experts=num_experts, top_k=top_k, group_size=16,
                  router=TokenChoiceRouter(dropless=True), router_init_std=2.0)
  auxes, _ = _compare(cfg, DROPLESS_ENGINES, seed=top_k)
  assert all(float(aux["drop_fraction"]) == 0 for aux in auxes)


@pytest.mark.parametrize("router", [TokenChoiceRouter(), ExpertChoiceRouter()])
def test_ragged_honours_capacity_drops(router):
  cfg = MoeConfig(num_experts=4, top_k=2, group_size=16, capacity_factor_train=0.5,
                  min_capacity=1, router=router, router_init_std=2.0)
  _compare(cfg, [RaggedDispatcher("padded", tile=4)])


def test_ragged_equals_einsum_when_nothing_drops():
  dropless = MoeConfig(num_experts=4, top_k=2, group_size=16, router_init_std=0.1,
                       router=TokenChoiceRouter(dropless=True))
  ample = dropless.replace(router=TokenChoiceRouter(), capacity_factor_train=4.0)
  _, want_aux = _compare(dropless, [RaggedDispatcher()], reference_cfg=ample)
  assert float(want_aux["drop_fraction"]) == 0


def test_dispatcher_chosen_by_gin():
  gin.parse_config("""
      MoeConfig.dispatcher = @RaggedDispatcher()
      RaggedDispatcher.backend = "ragged_dot"
  """)
  cfg = MoeConfig()
  assert cfg.dispatcher == RaggedDispatcher(backend="ragged_dot")
  gin.clear_config()
  assert MoeConfig().dispatcher is None
  assert isinstance(dispatcher_of(MoeConfig()), AutoDispatcher)
  with pytest.raises(ValueError, match="backend"):
    RaggedDispatcher(backend="nope")


def test_dispatchers_agree_inside_the_scanned_decoder():
  moe = MoeConfig(num_experts=4, top_k=2, group_size=16,
                  router=TokenChoiceRouter(dropless=True))
  cfg = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                    num_layers=4, moe=moe)
  tokens_bt = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, 64)
  params = nn.unbox(jax.jit(Decoder(cfg).init)(jax.random.PRNGKey(1), tokens_bt))["params"]

  def loss_and_grads(dispatcher):
    model = Decoder(cfg.replace(moe=moe.replace(dispatcher=dispatcher)))
    loss = lambda p: jnp.mean(model.apply({"params": p}, tokens_bt)[0] ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)

  want = loss_and_grads(EinsumDispatcher())
  for dispatcher in (SortDispatcher(), RaggedDispatcher(), BlockDispatcher()):
    got = loss_and_grads(dispatcher)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_block_chunk_size_follows_the_mean_rows_per_expert(monkeypatch):
  """`BlockDispatcher()` chunks by `chunk_rows` of the static mean kept rows per
  expert (largest power of two <= half of it, in [128, 512]); an explicit `big`
  wins."""
  assert [block.chunk_rows(m) for m in (1, 128, 255, 256, 512, 700, 1024, 4096)] == [
      128, 128, 128, 128, 256, 256, 512, 512]
  seen = []
  real = block.chunked_expert_ffn
  monkeypatch.setattr(block, "chunked_expert_ffn",
                      lambda *args: seen.append(args[7]) or real(*args))
  x_btd = jax.random.normal(jax.random.PRNGKey(0), (4, 512, D))
  # Dropless top-2 over 2048 tokens and 4 experts: 1024 rows per expert -> 512;
  # capacity 1.0 per token: 512 slots per expert -> 256.
  for router, cf, big, want in [(TokenChoiceRouter(dropless=True), 1.0, None, 512),
                                (TokenChoiceRouter(), 1.0, None, 256),
                                (TokenChoiceRouter(), 1.0, 32, 32)]:
    cfg = MoeConfig(num_experts=4, top_k=2, group_size=2048, router=router,
                    capacity_factor_train=cf, dispatcher=BlockDispatcher(big=big))
    layer = MoeLayer(cfg, "swiglu", D_FF)
    # Traced only (the chunk size is static): run op by op, this took 100 s.
    params = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(1), x_btd, train=True))
    jax.eval_shape(lambda p: layer.apply(p, x_btd, train=True), params)
    assert seen.pop().big == want
