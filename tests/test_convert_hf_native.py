"""transformers-native layouts: our logits equal transformers' own Mixtral,
Qwen3-MoE and GLM-4-MoE on the exported folder; round trips are bit-exact; what
transformers writes loads here; anything that does not map is refused in one line."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import torch
import transformers

from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.convert import hf_native
from openmoe_jax.convert.hf_experts import stack_reader
from openmoe_jax.convert.hf_native import (GLM4_MOE, MIXTRAL, QWEN3_MOE,
                                           export_hf_tensors, import_hf_tensors)
from openmoe_jax.convert.layout import ConversionError, Layout, Rule, import_tensors
from openmoe_jax.model import Decoder
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter

DROPLESS = TokenChoiceRouter(dropless=True)
# d_model differs from 2 * expert_d_ff: transformers' fused gate_up_proj [E, 2f, d]
# splits on the right axis only.
MIXTRAL_CFG = ModelConfig(
    vocab_size=64, d_model=40, num_heads=2, head_dim=8, d_ff=24, num_layers=2,
    mlp_kind="swiglu", sparse_interval=1, rope_base=5e5, norm_eps=1e-5,
    moe=MoeConfig(num_experts=4, top_k=2, expert_d_ff=16, renormalize_gates=True,
                  residual_mlp=False, router=DROPLESS))
QWEN3_CFG = MIXTRAL_CFG.replace(  # an MoE layer at an even index: decoder_sparse_step 1
    num_layers=4, layer_pattern="DMMD", qk_norm=True, rope_base=1e4,
    moe=MIXTRAL_CFG.moe.replace(renormalize_gates=False))
GLM4_CFG = MIXTRAL_CFG.replace(
    num_layers=3, layer_pattern="DMM", qk_norm=True,
    moe=MIXTRAL_CFG.moe.replace(gate="sigmoid", routed_scaling_factor=2.5,
                                num_shared_experts=1, shared_expert_d_ff=32))
CASES = {  # layout name -> (layout, config, transformers class, config function)
    "mixtral": (MIXTRAL, MIXTRAL_CFG, transformers.MixtralForCausalLM,
                hf_native.mixtral_hf_config),
    "qwen3_moe": (QWEN3_MOE, QWEN3_CFG, transformers.Qwen3MoeForCausalLM,
                  hf_native.qwen3_moe_hf_config),
    "glm4_moe": (GLM4_MOE, GLM4_CFG, transformers.Glm4MoeForCausalLM,
                 hf_native.glm4_moe_hf_config),
}
TOKENS = np.random.default_rng(0).integers(0, 64, (2, 12))


def _shapes(cfg):
  init = lambda: Decoder(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
  return nn.unbox(jax.eval_shape(init)["params"])


def _random_params(cfg, seed=1):
  """Random weights (numpy, drawn from the shapes: no model init) that make every
  mapping visible: norm scales away from 1, router weights large enough that gates
  differ clearly between experts."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    keys = [getattr(k, "key", "") for k in path]
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if "scale" in keys:
      return 1 + 0.3 * noise
    std = 1.0 if "embed" in keys else 0.5 if "router" in keys else cfg.d_model ** -0.5
    return std * noise
  return jax.tree_util.tree_map_with_path(draw, _shapes(cfg))


def _our_logits(cfg, params):
  apply = jax.jit(lambda p, t: Decoder(cfg).apply({"params": p}, t)[0])
  return np.asarray(apply(params, jnp.asarray(TOKENS)))


def _save(folder, cfg, params, layout, config_fn):
  tensors = dict(export_hf_tensors(params, cfg, layout))
  safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"),
                              metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(config_fn(cfg)))
  return tensors


def _hf_logits(model_cls, folder):
  model, info = model_cls.from_pretrained(
      str(folder), dtype=torch.float32, attn_implementation="eager",
      output_loading_info=True)
  assert not any(info.values()), info  # nothing missing, unexpected or mismatched
  with torch.no_grad():
    return model.eval()(input_ids=torch.from_numpy(TOKENS)).logits.numpy()


def _read_folder(folder):
  with safetensors.safe_open(str(folder / "model.safetensors"), "np") as f:
    return {name: f.get_tensor(name) for name in f.keys()}


def _assert_trees_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_computes_our_logits_from_the_export(name, tmp_path):
  layout, cfg, model_cls, config_fn = CASES[name]
  params = _random_params(cfg)
  _save(tmp_path, cfg, params, layout, config_fn)
  diff = np.max(np.abs(_hf_logits(model_cls, tmp_path) - _our_logits(cfg, params)))
  print(f"{name}: max abs logits difference {diff:.2e}")
  assert diff < 1e-4


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_is_bit_exact(name):
  layout, cfg, _, _ = CASES[name]
  params = _random_params(cfg)
  tensors = dict(export_hf_tensors(params, cfg, layout))
  messages = []
  back = import_hf_tensors(tensors.__getitem__, list(tensors), cfg, layout,
                           _shapes(cfg), progress=messages.append)
  _assert_trees_equal(back, jax.tree.map(np.asarray, params))
  # One progress line per layer, in depth order.
  assert messages == [f"  layer {i}/{cfg.num_layers}"
                      for i in range(1, cfg.num_layers + 1)]


def test_unscanned_layers_export_the_same_tensors():
  params = _random_params(QWEN3_CFG)
  tensors = dict(export_hf_tensors(params, QWEN3_CFG, QWEN3_MOE))
  cfg = QWEN3_CFG.replace(scan_layers=False)
  unscanned = import_hf_tensors(tensors.__getitem__, list(tensors), cfg, QWEN3_MOE,
                                _shapes(cfg))
  again = dict(export_hf_tensors(unscanned, cfg, QWEN3_MOE))
  assert sorted(again) == sorted(tensors)
  for name, array in tensors.items():
    np.testing.assert_array_equal(again[name], array)


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_transformers_saves_loads_here(name, tmp_path):
  # transformers' own random model, written by save_pretrained in both forms: the
  # default per-expert names and its fused in-memory names.
  layout, cfg, model_cls, config_fn = CASES[name]
  torch.manual_seed(0)
  model = model_cls(transformers.AutoConfig.for_model(**config_fn(cfg))).eval()
  with torch.no_grad():
    for module in model.modules():  # routing that depends clearly on the weights
      if hasattr(module, "top_k") and hasattr(module, "weight"):
        module.weight.normal_(0, 0.5)
    want = model(input_ids=torch.from_numpy(TOKENS)).logits.numpy()
  trees = []
  for original in (True, False):
    folder = tmp_path / str(original)
    model.save_pretrained(str(folder), save_original_format=original)
    tensors = _read_folder(folder)
    assert any(".experts.0." in n for n in tensors) == original
    trees.append(import_hf_tensors(tensors.__getitem__, list(tensors), cfg, layout,
                                   _shapes(cfg)))
  _assert_trees_equal(trees[1], trees[0])
  assert np.max(np.abs(_our_logits(cfg, trees[0]) - want)) < 1e-4


REFUSALS = [  # layout, change to its test config, option named, layouts that take it
    ("mixtral", {"layer_pattern": "DM"}, "layer layout",
     "t5x, openmoe, qwen3_moe, glm4_moe"),
    ("mixtral", {"qk_norm": True}, "ModelConfig.qk_norm", "qwen3_moe, glm4_moe"),
    ("mixtral", {"mlp_kind": "openmoe_swiglu"}, "ModelConfig.mlp_kind", "t5x, openmoe"),
    ("mixtral", {"scale_attention_logits": False},
     "ModelConfig.scale_attention_logits", "t5x, openmoe"),
    ("mixtral", {"moe.renormalize_gates": False}, "MoeConfig.renormalize_gates",
     "t5x, openmoe, qwen3_moe, glm4_moe"),
    ("mixtral", {"moe.residual_mlp": True}, "MoeConfig.residual_mlp", "t5x, openmoe"),
    ("qwen3_moe", {"qk_norm": False}, "ModelConfig.qk_norm",
     "t5x, openmoe, mixtral, glm4_moe"),
    ("qwen3_moe", {"moe.gate": "sigmoid"}, "MoeConfig.gate", "glm4_moe"),
    ("qwen3_moe", {"moe.num_shared_experts": 1}, "MoeConfig.num_shared_experts",
     "glm4_moe"),
    ("qwen3_moe", {"moe.routed_scaling_factor": 2.0}, "MoeConfig.routed_scaling_factor",
     "glm4_moe"),
    ("qwen3_moe", {"moe.router": ExpertChoiceRouter()}, "MoeConfig.router", None),
    ("glm4_moe", {"num_layers": 4, "layer_pattern": "DMDM"}, "layer layout",
     "t5x, openmoe, qwen3_moe"),
    ("glm4_moe", {"moe.gate": "softmax"}, "MoeConfig.gate",
     "t5x, openmoe, mixtral, qwen3_moe"),
    ("glm4_moe", {"moe.num_shared_experts": 0}, "MoeConfig.num_shared_experts",
     "t5x, openmoe, mixtral, qwen3_moe"),
    ("glm4_moe", {"moe.shared_expert_d_ff": 24}, "shared_expert_d_ff 24", None),
    ("glm4_moe", {"moe.shared_experts_gated": True}, "shared_experts_gated", None),
]


@pytest.mark.parametrize("name,change,option,takers", REFUSALS)
def test_options_that_do_not_map_are_refused(name, change, option, takers):
  layout, cfg, _, config_fn = CASES[name]
  moe = {k[4:]: v for k, v in change.items() if k.startswith("moe.")}
  cfg = cfg.replace(moe=cfg.moe.replace(**moe),
                    **{k: v for k, v in change.items() if not k.startswith("moe.")})
  calls = [lambda: list(export_hf_tensors({}, cfg, layout)),
           lambda: import_hf_tensors(None, [], cfg, layout, {}),
           lambda: config_fn(cfg)]
  for call in calls:
    with pytest.raises(ConversionError) as error:
      call()
    message = str(error.value)
    assert "\n" not in message and option in message and repr(name) in message
    assert message.endswith(f"layouts that take it: {takers}" if takers
                            else "no layout takes it"), message


@pytest.mark.parametrize("name,change,parameter,shapes", [
    ("mixtral", {"expert_d_ff": 20}, "layers.0.moe.experts.wi_0",
     ("(4, 16, 40)", "(4, 20, 40)")),
    ("qwen3_moe", {"d_ff": 20}, "layers.0.mlp.wi_0", ("(24, 40)", "(20, 40)")),
    ("glm4_moe", {"shared_expert_d_ff": 48}, "layers.1.moe.shared_experts.wi_0",
     ("(32, 40)", "(48, 40)")),
])
def test_a_shape_that_does_not_fit_names_the_parameter(name, change, parameter, shapes):
  layout, cfg, _, _ = CASES[name]
  tensors = dict(export_hf_tensors(_random_params(cfg), cfg, layout))
  moe = {k: v for k, v in change.items() if k != "d_ff"}
  other = cfg.replace(moe=cfg.moe.replace(**moe),
                      **{k: v for k, v in change.items() if k == "d_ff"})
  with pytest.raises(ConversionError) as error:
    import_hf_tensors(tensors.__getitem__, list(tensors), other, layout,
                      _shapes(other))
  message = str(error.value)
  assert parameter in message and all(s in message for s in shapes), message


def test_broken_expert_lists_and_nonzero_selection_bias_are_refused():
  tensors = dict(export_hf_tensors(_random_params(GLM4_CFG), GLM4_CFG, GLM4_MOE))
  shapes = _shapes(GLM4_CFG)

  def load(changed):
    return import_hf_tensors(changed.__getitem__, list(changed), GLM4_CFG, GLM4_MOE,
                             shapes)
  for missing in (2, 0):  # of 4: three left, which should be numbered 0..2
    gap = {n: a for n, a in tensors.items() if f".experts.{missing}." not in n}
    with pytest.raises(ConversionError, match=rf"not numbered 0\.\.2: expert {missing} "
                       "is missing"):
      load(gap)
  # Expert 1 differs: the message names it and expert 0's shape.
  odd = dict(tensors, **{"model.layers.1.mlp.experts.1.up_proj.weight":
                         np.zeros((8, 40), np.float32)})
  with pytest.raises(ConversionError, match=r"experts.1.up_proj.weight' has shape "
                     r"\(8, 40\), but .*experts.0.up_proj.weight' has \(16, 40\)"):
    load(odd)
  bias = "model.layers.2.mlp.gate.e_score_correction_bias"
  with pytest.raises(ConversionError, match="e_score_correction_bias' is not zero"):
    load(dict(tensors, **{bias: np.ones(4, np.float32)}))
  with pytest.raises(ConversionError, match="no tensor 'model.layers.2.mlp.gate.weight'"):
    load({n: a for n, a in tensors.items() if n != "model.layers.2.mlp.gate.weight"})


def test_a_rule_for_a_parameter_the_model_lacks_is_a_conversion_error():
  """A layout that names a parameter missing from the model's tree (absent, or
  below a leaf) is refused by name, not with a KeyError or IndexError; one that
  leaves a parameter unfilled too."""
  shapes = {"a": jax.ShapeDtypeStruct((2,), jnp.float32),
            "x": jax.ShapeDtypeStruct((3,), jnp.float32)}
  read = lambda name: np.ones(2 if name == "a" else 3, np.float32)
  for ours, shown in ((("y",), "y"), (("x", "b"), "x.b")):
    layout = Layout("toy", lambda cfg, ours=ours: [Rule("a", ("a",)), Rule("b", ours)],
                    lambda cfg, i, sparse: [])
    with pytest.raises(ConversionError, match=f"'b' to parameter {shown}, which this "
                       "gin model does not have"):
      import_tensors(read, ["a", "b"], MIXTRAL_CFG, layout, shapes)
  # And a parameter that no rule fills: the layout cannot carry the model.
  layout = Layout("toy", lambda cfg: [Rule("a", ("a",))], lambda cfg, i, sparse: [])
  with pytest.raises(ConversionError, match="'toy' has no tensor for parameter x:"):
    import_tensors(read, ["a"], MIXTRAL_CFG, layout, shapes)
  # And tensors the layout does not use: the checkpoint is not of this gin model.
  both = Layout("toy", lambda cfg: [Rule("a", ("a",)), Rule("x", ("x",))],
                lambda cfg, i, sparse: [])
  with pytest.raises(ConversionError, match="the checkpoint holds 2 tensor\\(s\\) the "
                     "gin model has no place for, e.g. 'extra.0': is the gin model the "
                     "one it was trained with"):
    import_tensors(read, ["a", "x", "extra.1", "extra.0"], MIXTRAL_CFG, both, shapes)


def test_per_expert_tensors_stack_in_expert_number_order_past_ten():
  """12 experts saved one tensor each: the stack holds expert j at row j (numeric
  order: 10 and 11 after 9, not after 1)."""
  names = [f"model.layers.0.mlp.experts.{j}.gate_proj.weight" for j in range(12)]
  read, stacked = stack_reader(lambda name: np.full((2, 3), int(name.split(".")[5]),
                                                    np.float32), names[::-1])
  assert stacked == ["model.layers.0.mlp.experts.*.gate_proj.weight"]
  np.testing.assert_array_equal(read(stacked[0])[:, 0, 0], np.arange(12))


def test_a_selection_bias_with_a_single_nonzero_entry_is_refused():
  """GLM's e_score_correction_bias has no counterpart: only an all-zero one loads
  (one nonzero expert entry changes which experts are selected)."""
  tensors = dict(export_hf_tensors(_random_params(GLM4_CFG), GLM4_CFG, GLM4_MOE))
  bias = "model.layers.2.mlp.gate.e_score_correction_bias"
  np.testing.assert_array_equal(tensors[bias], np.zeros(4, np.float32))
  tensors[bias] = np.array([0.0, 0.0, 0.5, 0.0], np.float32)
  with pytest.raises(ConversionError, match="e_score_correction_bias' is not zero"):
    import_hf_tensors(tensors.__getitem__, list(tensors), GLM4_CFG, GLM4_MOE,
                      _shapes(GLM4_CFG))


@pytest.fixture(scope="module")
def vocabulary_and_batch():
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  return (pipeline.vocabulary_for("local_text"),
          next(pipeline.get_dataset("local_text", 16, 2, pack=False)))


@pytest.mark.parametrize("name", sorted(CASES) + ["openmoe"])
def test_config_special_tokens_are_our_data_pipelines_and_nothing_else_acts(
    name, vocabulary_and_batch):
  """generate() and tokenizers read bos/eos/pad from config.json: they must be the ids
  our data uses (the vocabulary's pad and eos; bos = the id the feature converter
  shifts in at each row's start), and a model trained here has no dropout."""
  from openmoe_jax.convert.openmoe import openmoe_hf_config  # pylint: disable=g-import-not-at-top
  if name == "openmoe":
    config = openmoe_hf_config(MIXTRAL_CFG)
  else:
    config = CASES[name][3](CASES[name][1])
  vocab, batch = vocabulary_and_batch
  assert config["pad_token_id"] == vocab.pad_id
  assert config["eos_token_id"] == vocab.eos_id
  assert (batch["decoder_input_tokens"][:, 0] == config["bos_token_id"]).all()
  assert (batch["decoder_input_tokens"][:, 1:] == batch["decoder_target_tokens"][:, :-1]
          ).all()
  dropouts = {k: v for k, v in config.items() if "dropout" in k or "jitter" in k}
  assert dropouts and not any(dropouts.values()), dropouts
  # Our head is its own parameter and no projection has a bias: transformers would
  # tie lm_head to the embedding, or add biases, were these true.
  assert config["tie_word_embeddings"] is False and config["attention_bias"] is False


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_run_time_switches_are_transformers_defaults(name):
  """Switches that change what a loaded model returns or keeps, not its weights:
  the values transformers' own config class starts with (an exported model
  behaves like one built there)."""
  _, cfg, model_cls, config_fn = CASES[name]
  config, default = config_fn(cfg), model_cls.config_class()
  switches = [k for k in ("output_router_logits", "use_cache", "use_sliding_window",
                          "initializer_range") if hasattr(default, k)]
  assert len(switches) >= 3, switches
  assert {k: config[k] for k in switches} == {k: getattr(default, k) for k in switches}


def test_glm4_config_is_full_rotary_with_no_multi_token_prediction_layers():
  config = hf_native.glm4_moe_hf_config(GLM4_CFG)
  # transformers 4.x reads the top-level factor, 5.x the one in rope_parameters.
  assert config["partial_rotary_factor"] == 1.0
  assert config["rope_parameters"]["partial_rotary_factor"] == 1.0
  # GLM checkpoints keep their multi-token-prediction layers after the others, as
  # model.layers.{num_hidden_layers + j}: the export's layers are exactly the count.
  names = [n for n, _ in export_hf_tensors(_random_params(GLM4_CFG), GLM4_CFG, GLM4_MOE)]
  layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
  assert layers == set(range(config["num_hidden_layers"]
                             + config["num_nextn_predict_layers"]))


def test_the_gin_model_to_import_into_needs_a_file_and_a_vocabulary_size():
  """openmoe-convert from-hf / from-t5x build the model from gin: the task's
  vocabulary (rounded up to 128 rows), else ModelConfig.vocab_size, else a clear
  refusal."""
  from openmoe_jax.cli import convert as convert_cli  # pylint: disable=g-import-not-at-top
  from_gin = convert_cli._model_from_gin  # pylint: disable=protected-access
  with pytest.raises(ConversionError, match="--gin_file is required"):
    from_gin([], [], [])
  with pytest.raises(ConversionError, match=r"the gin files name no task \(train."
                     r"mixture_or_task_name\) and bind no ModelConfig.vocab_size"):
    from_gin(["models/quickstart_moe.gin"], [], [])
  assert from_gin(["models/quickstart_moe.gin"], ["ModelConfig.vocab_size = 200"],
                  []).vocab_size == 200
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  task_vocab = pipeline.vocabulary_for("local_mix").vocab_size
  assert task_vocab % 128 and from_gin(["runs/quickstart.gin"], [], []).vocab_size == (
      task_vocab // 128 + 1) * 128


def test_an_unknown_architecture_or_an_unset_vocabulary_is_refused():
  from openmoe_jax.convert import registry  # pylint: disable=g-import-not-at-top
  assert registry.layout_of({"architectures": ["Qwen3MoeForCausalLM"]}) == "qwen3_moe"
  for config_json, shown in (({"architectures": ["LlamaForCausalLM"]},
                              r"\['LlamaForCausalLM'\]"), ({}, "None")):
    with pytest.raises(ConversionError, match=f"config.json architectures {shown} match "
                       "no layout \\(glm4_moe, mixtral, openmoe, qwen3_moe\\); pass --layout"):
      registry.layout_of(config_json)
  with pytest.raises(ConversionError, match="ModelConfig.vocab_size is unset"):
    hf_native.llama_config_fields(MIXTRAL_CFG.replace(vocab_size=None))
