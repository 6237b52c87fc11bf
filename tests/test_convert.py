"""openmoe-convert: t5x in (against an independent NumPy OpenMoE forward), the
OpenMoE Hugging Face layout and params exports round trip bit-exactly, refusals."""
import json
import os
import shutil

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import gin_utils, load_model
from openmoe_jax.checkpoints import Checkpointer
from openmoe_jax.cli import convert as convert_cli
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.convert import params_export
from openmoe_jax.convert.layout import ConversionError
from openmoe_jax.convert.hf_io import (INDEX, SafetensorsReader, write_safetensors,
                                      write_tokenizer)
from openmoe_jax.convert.openmoe import moe_interval, openmoe_hf_config
from openmoe_jax.convert.t5x_reader import find_checkpoint_dir
from openmoe_jax.data import pipeline
from openmoe_jax.data import vocabulary as vocab_lib
from openmoe_jax.model import Decoder
from openmoe_jax.moe.routers_token_choice import TokenChoiceRouter
from openmoe_jax.trainer import TrainState
from openmoe_numpy_forward import openmoe_logits
from t5x_format import write_t5x_checkpoint

D, H, HD, F, E, V, LAYERS, INTERVAL = 32, 2, 8, 16, 4, 64, 4, 2
# OpenMoE's preset, shrunk; capacity large enough that nothing drops (the NumPy
# forward routes without capacity).
GIN = ["--gin_file=models/openmoe_base_16e.gin"] + [
    f"--gin.{k}={v}" for k, v in {
        "ModelConfig.d_model": D, "ModelConfig.num_heads": H, "ModelConfig.head_dim": HD,
        "ModelConfig.d_ff": F, "ModelConfig.num_layers": LAYERS,
        "ModelConfig.sparse_interval": INTERVAL, "ModelConfig.vocab_size": V,
        "MoeConfig.num_experts": E, "MoeConfig.group_size": 64,
        "MoeConfig.min_capacity": 64}.items()]


def _t5x_weights(seed=0):
  """Returns random OpenMoE weights under t5x names with t5x shapes."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(0, 0.3, shape).astype(np.float32)
  w = {"token_embedder/embedding": normal(V, D),
       "decoder/decoder_norm/scale": 1 + normal(D),
       "decoder/logits_dense/kernel": normal(D, V)}
  for i in range(LAYERS):
    p = f"decoder/layers_{i}/"
    w[p + "pre_self_attention_layer_norm/scale"] = 1 + normal(D)
    for n in ("query", "key", "value"):
      w[p + f"self_attention/{n}/kernel"] = normal(D, H * HD)
    w[p + "self_attention/out/kernel"] = normal(H * HD, D)
    w[p + "pre_mlp_layer_norm/scale"] = 1 + normal(D)
    mlps = ["extra_mlp"] if (i + 1) % INTERVAL == 0 else ["mlp"]
    if (i + 1) % INTERVAL == 0:
      w[p + "mlp/router/router_weights/w/kernel"] = normal(D, E)
      w[p + "mlp/expert/wi_0/kernel"] = normal(E, D, 2 * F)
      w[p + "mlp/expert/wi_1/kernel"] = normal(E, D, F)
      w[p + "mlp/expert/wo/kernel"] = normal(E, F, D)
      w[p + "pre_extra_mlp_layer_norm/scale"] = 1 + normal(D)
    for m in mlps:
      w[p + f"{m}/wi_0/kernel"] = normal(D, 2 * F)
      w[p + f"{m}/wi_1/kernel"] = normal(D, F)
      w[p + f"{m}/wo/kernel"] = normal(F, D)
  return w


def _convert(*args):
  lines = []
  convert_cli.run(list(args), say=lines.append)
  return lines


def _tokens():
  return np.random.default_rng(1).integers(0, V, (2, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def t5x_export(tmp_path_factory):
  """(t5x weights, t5x folder, params export converted from it)."""
  root = tmp_path_factory.mktemp("t5x")
  weights = _t5x_weights()
  write_t5x_checkpoint(str(root / "ckpt"), 1000, weights)
  out = str(root / "export")
  _convert("from-t5x", f"--checkpoint={root / 'ckpt'}", f"--output={out}", "--step=7",
           *GIN)
  return weights, str(root / "ckpt"), out


def test_t5x_checkpoint_loads_to_openmoes_own_forward(t5x_export):
  weights, _, out = t5x_export
  model, params, vocab = load_model(out)
  assert vocab is None  # the preset binds vocab_size and names no task
  assert not model.config.scale_attention_logits
  tokens = _tokens()
  logits, aux = model.apply({"params": params}, jnp.asarray(tokens))
  assert float(jnp.max(aux["drop_fraction"])) == 0.0
  expected = openmoe_logits(weights, tokens, num_layers=LAYERS, moe_interval=INTERVAL,
                            num_heads=H, head_dim=HD)
  # float32 (ours) against float64: measured 9.9e-5 max abs on logits up to 6.8
  # (1.5e-5 relative); a wrong scale, layout or routing changes logits by O(1).
  np.testing.assert_allclose(np.asarray(logits), expected, atol=3e-4, rtol=1e-4)


def test_t5x_export_records_step_and_source(t5x_export):
  _, ckpt, out = t5x_export
  with open(os.path.join(out, "export.json")) as f:
    meta = json.load(f)
  assert meta["step"] == 7 and ckpt in meta["source"]
  assert meta["num_params"] == sum(np.size(w) for w in _t5x_weights().values())


def test_openmoe_hf_round_trip_is_bit_exact(t5x_export, tmp_path):
  _, _, out = t5x_export
  hf = str(tmp_path / "hf")
  _convert("to-hf", f"--model_dir={out}", f"--output={hf}", "--layout=openmoe",
           "--max_shard_gb=0.00002")  # ~20 kB shards: exercises the shard index
  files = os.listdir(hf)
  assert "model.safetensors.index.json" in files and "config.json" in files
  # Shards are filled up to --max_shard_gb (in GiB) of tensor bytes: a shard holds
  # several tensors unless one alone is larger.
  with open(os.path.join(hf, INDEX)) as f:
    weight_map = json.load(f)["weight_map"]
  reader, per_shard = SafetensorsReader(hf), {}
  for name, shard in weight_map.items():
    per_shard.setdefault(shard, []).append(reader.read(name).nbytes)
  limit = 0.00002 * 2**30
  assert max(len(sizes) for sizes in per_shard.values()) > 1
  assert all(sum(sizes) <= limit or len(sizes) == 1 for sizes in per_shard.values())
  with open(os.path.join(hf, "config.json")) as f:
    config = json.load(f)
  assert (config["moe_layer_interval"], config["num_experts"], config["head_dim"]) == (
      INTERVAL, E, HD)
  back = str(tmp_path / "back")
  _convert("from-hf", f"--checkpoint={hf}", f"--output={back}", *GIN)
  _, original, _ = load_model(out)
  _, restored, _ = load_model(back)
  jax.tree.map(np.testing.assert_array_equal, original, restored)
  # --dtype casts on the way in; float32, the default, leaves the values alone.
  half = str(tmp_path / "half")
  _convert("from-hf", f"--checkpoint={hf}", f"--output={half}", "--dtype=bfloat16",
           *GIN)
  with open(os.path.join(half, "export.json")) as f:
    assert json.load(f)["dtype"] == "bfloat16"
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      np.asarray(a), np.asarray(b).astype(jnp.bfloat16)), params_export.restore(half),
               original)


def _fails(capsys, *args):
  assert convert_cli.main(list(args)) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("openmoe-convert: error: ")
  return err[0]


def test_shape_mismatch_names_the_parameter_and_both_shapes(t5x_export, tmp_path,
                                                             capsys):
  _, ckpt, _ = t5x_export
  out = tmp_path / "out"
  err = _fails(capsys, "from-t5x", f"--checkpoint={ckpt}", f"--output={out}", *GIN,
               "--gin.ModelConfig.d_ff=24")
  assert "layers.0.mlp.wi_0" in err and "(32, 32)" in err and "(32, 48)" in err
  assert not out.exists()


def test_a_checkpoint_written_to_gcs_reads_like_a_local_one(t5x_export, tmp_path):
  """t5x run on gs:// (as OpenMoE's were) writes specs with a dummy gcs bucket and the
  array's folder at the spec's top level, not in its kvstore."""
  weights, _, local = t5x_export
  write_t5x_checkpoint(str(tmp_path / "ckpt"), 1000, weights, gcs=True)
  out = str(tmp_path / "export")
  _convert("from-t5x", f"--checkpoint={tmp_path / 'ckpt'}", f"--output={out}",
           "--step=7", *GIN)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params_export.restore(out), params_export.restore(local))
  step_dir = tmp_path / "ckpt" / "checkpoint_1000"
  shutil.rmtree(step_dir / "target.decoder.layers_0.mlp.wo.kernel")
  with pytest.raises(ConversionError, match="layers_0/mlp/wo/kernel: its array folder .*"
                     "target.decoder.layers_0.mlp.wo.kernel is missing"):
    _convert("from-t5x", f"--checkpoint={tmp_path / 'ckpt'}",
             f"--output={tmp_path / 'again'}", *GIN)


def test_missing_array_folder_is_named(t5x_export, tmp_path, capsys):
  _, ckpt, _ = t5x_export
  broken = tmp_path / "broken"
  shutil.copytree(ckpt, broken)
  step_dir = broken / "checkpoint_1000"
  shutil.rmtree(step_dir / "target.decoder.layers_1.mlp.expert.wo.kernel")
  out = tmp_path / "out"
  err = _fails(capsys, "from-t5x", f"--checkpoint={broken}", f"--output={out}", *GIN)
  assert "decoder/layers_1/mlp/expert/wo/kernel" in err and "missing" in err
  assert not out.exists()
  err = _fails(capsys, "from-t5x", f"--checkpoint={tmp_path / 'nowhere'}",
               f"--output={out}", *GIN)
  assert "no such directory" in err


def test_unsupported_option_is_refused_with_the_layouts_that_take_it(tmp_path, capsys):
  run = tmp_path / "run"
  gin.clear_config()
  gin_utils.import_configurables()
  cfg = ModelConfig(vocab_size=V, d_model=D, num_heads=H, head_dim=HD, d_ff=F,
                    num_layers=2, sparse_interval=2, qk_norm=True,
                    scale_attention_logits=False)
  params = nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(0),
                                      jnp.zeros((1, 8), jnp.int32))["params"])
  with Checkpointer(str(run)) as ckpt:
    ckpt.save(1, TrainState(step=np.asarray(1, np.int32), params=params, opt_state={}),
              force=True)
  (run / "config.gin").write_text("\n".join(
      f"ModelConfig.{k} = {v!r}" for k, v in dict(
          vocab_size=V, d_model=D, num_heads=H, head_dim=HD, d_ff=F, num_layers=2,
          sparse_interval=2, qk_norm=True, scale_attention_logits=False).items()))
  out = tmp_path / "hf"
  err = _fails(capsys, "to-hf", f"--model_dir={run}", f"--output={out}", "--layout=openmoe")
  assert "qk_norm = True" in err and "'openmoe'" in err
  assert not out.exists()


def _colossalai_to_t5x(hf_tensors):
  """Returns t5x-named weights from the OpenMoE Hugging Face layout by inverting
  ColossalAI's convert_openmoe_ckpt.py mapping (written here independently)."""
  w = {"token_embedder/embedding": hf_tensors["model.embed_tokens.weight"],
       "decoder/decoder_norm/scale": hf_tensors["model.norm.weight"],
       "decoder/logits_dense/kernel": hf_tensors["lm_head.weight"].T}
  for i in range(LAYERS):
    hf, p = f"model.layers.{i}.", f"decoder/layers_{i}/"
    w[p + "pre_self_attention_layer_norm/scale"] = hf_tensors[hf + "input_layernorm.weight"]
    for t5x, torch_name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"),
                            ("out", "o_proj")):
      w[p + f"self_attention/{t5x}/kernel"] = hf_tensors[hf + f"self_attn.{torch_name}.weight"].T
    w[p + "pre_mlp_layer_norm/scale"] = hf_tensors[hf + "post_attention_layernorm.weight"]
    mlp = "mlp"
    if (i + 1) % INTERVAL == 0:
      w[p + "mlp/router/router_weights/w/kernel"] = hf_tensors[hf + "mlp.gate_weight"].T
      for t5x, name in (("wi_0", "wi_gate"), ("wi_1", "wi_up"), ("wo", "wo")):
        w[p + f"mlp/expert/{t5x}/kernel"] = hf_tensors[hf + f"mlp.experts.{name}"]
      w[p + "pre_extra_mlp_layer_norm/scale"] = hf_tensors[hf + "pre_extra_mlp_layernorm.weight"]
      mlp = "extra_mlp"
    for t5x, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
      w[p + f"{mlp}/{t5x}/kernel"] = hf_tensors[hf + f"{mlp}.{name}.weight"].T
  return w


def test_openmoe_hf_export_holds_colossalais_layout(t5x_export, tmp_path):
  """The exported tensors, read back through ColossalAI's own name mapping, are the
  original t5x weights: a swap that a round trip cannot see would show here."""
  weights, _, out = t5x_export
  hf = str(tmp_path / "hf")
  _convert("to-hf", f"--model_dir={out}", f"--output={hf}", "--layout=openmoe")
  reader = SafetensorsReader(hf)
  mapped = _colossalai_to_t5x({n: reader.read(n) for n in reader.names})
  assert set(mapped) == set(weights) and len(reader.names) == len(weights)
  for name, value in weights.items():
    np.testing.assert_array_equal(mapped[name], value, err_msg=name)


def test_exported_tokenizer_encodes_like_our_vocabulary(tmp_path):
  import transformers  # pylint: disable=g-import-not-at-top
  gin_utils.import_configurables()
  vocab = pipeline.vocabulary_for("local_mix")
  write_tokenizer(str(tmp_path), vocab, 256)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert len(tokenizer) == vocab.vocab_size and tokenizer.eos_token_id == vocab.eos_id
  for text in ("def add(a, b):\n    return a + b\n", "Two  spaces\tand a tab",
               "<extra_id_0> sentinel", " leading space", "ünïcödé → 漢字"):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == vocab.encode(text), text
    assert tokenizer.sp_model.decode(ids) == text
  assert tokenizer.model_max_length == 256
  # transformers' decode keeps spaces before punctuation (no clean-up), as ours does.
  text = "f(a , b) ; x = y ! z ."
  ids = tokenizer.encode(text, add_special_tokens=False)
  assert tokenizer.decode(ids) == vocab.decode(ids) == text


def test_exported_tokenizer_keeps_the_dummy_prefix_of_a_t5_style_model(tmp_path):
  """umT5's model (OpenMoE's tokenizer) adds a dummy prefix "▁" before the text; our
  corpus model does not. Exported, transformers must keep it (legacy mode), or every
  first word gets other ids than seqio gives it."""
  import transformers  # pylint: disable=g-import-not-at-top
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top
  corpus_vocab = vocab_lib.get_vocabulary()
  with open(corpus_vocab.sentencepiece_model_file, "rb") as f:
    proto = sentencepiece_model_pb2.ModelProto.FromString(f.read())
  assert not proto.normalizer_spec.add_dummy_prefix
  proto.normalizer_spec.add_dummy_prefix = True
  model_file = tmp_path / "t5_style.model"
  model_file.write_bytes(proto.SerializeToString())
  vocab = vocab_lib.sentencepiece_vocabulary(str(model_file), corpus_vocab.extra_ids)
  texts = ("import numpy as np", "return x", " leading space")
  # The prefix is seen: the first word's pieces differ from the corpus model's.
  assert any(vocab.encode(t) != corpus_vocab.encode(t) for t in texts)
  (tmp_path / "hf").mkdir()
  write_tokenizer(str(tmp_path / "hf"), vocab)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  for text in texts:
    assert tokenizer.encode(text, add_special_tokens=False) == vocab.encode(text), text


def test_openmoe_hf_config_carries_each_router_setting_under_its_own_field():
  """config.json of ColossalAI's port: every router field holds its own setting (all
  values distinct, so a field copied from a neighbour shows)."""
  moe = MoeConfig(num_experts=E, top_k=2, capacity_factor_train=1.5,
                  capacity_factor_eval=2.5, min_capacity=3, lb_loss_weight=0.03,
                  z_loss_weight=0.0007)
  cfg = ModelConfig(vocab_size=V, d_model=D, num_heads=H, head_dim=HD, d_ff=F,
                    num_layers=LAYERS, sparse_interval=INTERVAL,
                    mlp_kind="openmoe_swiglu", moe=moe)
  config = openmoe_hf_config(cfg)
  assert config["router_aux_loss_factor"] == 0.03
  assert config["router_z_loss_factor"] == 0.0007
  assert config["router_capacity_factor_train"] == 1.5
  assert config["router_capacity_factor_eval"] == 2.5
  assert config["router_min_capacity"] == 3
  assert config["router_topk"] == 2 and config["num_experts"] == E
  assert config["moe_layer_interval"] == INTERVAL
  # The port drops tokens past capacity unless told not to: dropless routing says so.
  assert config["router_drop_tks"] is True
  dropless = cfg.replace(moe=moe.replace(router=TokenChoiceRouter(dropless=True)))
  assert openmoe_hf_config(dropless)["router_drop_tks"] is False


# ColossalAI's config.json of the released OpenMoE Base (examples/language/openmoe/
# model/openmoe_base_config.json), the fields we write, as it has them.
RELEASED_BASE_CONFIG = {
    "architectures": ["OpenMoeForCausalLM"],
    "auto_map": {"AutoModelForCausalLM": "modeling_openmoe.OpenMoeForCausalLM"},
    "attention_bias": False, "bos_token_id": 0, "dropout_rate": 0.0, "eos_token_id": 1,
    "head_dim": 64, "hidden_act": "swiglu", "hidden_size": 768,
    "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_epsilon": 1e-06,
    "max_position_embeddings": 2048, "mlp_gated": True, "model_type": "llama",
    "moe_layer_interval": 4, "num_attention_heads": 12, "num_experts": 16,
    "num_hidden_layers": 12, "num_key_value_heads": 12, "pad_token_id": 0,
    "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000.0, "router_aux_loss_factor": 0.01,
    "router_capacity_factor_eval": 2.0, "router_capacity_factor_train": 1.25,
    "router_drop_tks": True, "router_min_capacity": 4, "router_noisy_policy": None,
    "router_topk": 2, "router_z_loss_factor": 0.0001, "tie_word_embeddings": False,
    "torch_dtype": "float32", "use_cache": True, "vocab_size": 256384}
# Its other fields are the port's own training switches, not the model's: enable_*,
# expert_parallel, load_balance_*, its fine-tuning label_smoothing and z_loss_factor,
# transformers_version.


def test_openmoe_hf_config_of_the_base_preset_is_the_released_one():
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["models/openmoe_base_16e.gin"], finalize=False)
  config = openmoe_hf_config(ModelConfig())
  gin.clear_config()
  assert {k: (config[k], type(config[k])) for k in config} == {
      k: (v, type(v)) for k, v in RELEASED_BASE_CONFIG.items()}


@pytest.mark.parametrize("layers,interval", [
    # (sparse_interval, num_layers) of OpenMoE's presets: Base and 34B every 4th
    # layer, 8B every 6th (ColossalAI's moe_layer_interval).
    ((4, 12), 4), ((6, 24), 6), ((1, 3), 1), ("DMDM", 2), ("DDDMDDDM", 4), ("MMM", 1),
    # Not OpenMoE's layout: no k for which layer i is MoE iff (i + 1) % k == 0.
    ("DDDD", None), ((0, 4), None), ("DMDD", None), ("MDMD", None),
    ("DDDMDDDD", None), ("DMDMM", None), ("DDMDM", None)])
def test_moe_interval_is_openmoes_every_kth_layer_or_none(layers, interval):
  if isinstance(layers, str):
    cfg = ModelConfig(num_layers=len(layers), layer_pattern=layers)
  else:
    cfg = ModelConfig(num_layers=layers[1], sparse_interval=layers[0])
  assert moe_interval(cfg) == interval
  if interval:  # the port's rule, written out, gives back our layers
    assert cfg.sparse_layers() == tuple((i + 1) % interval == 0
                                        for i in range(cfg.num_layers))
    assert openmoe_hf_config(cfg)["moe_layer_interval"] == interval


def test_the_newest_t5x_checkpoint_is_found_by_step_number(tmp_path):
  """A t5x run folder: checkpoint_<step> folders with a `checkpoint` file; the
  newest is the largest step (10 after 9, numerically), and a folder without its
  `checkpoint` file does not count."""
  for step in (9, 10, 2):
    (tmp_path / f"checkpoint_{step}").mkdir()
    (tmp_path / f"checkpoint_{step}" / "checkpoint").write_bytes(b"")
  (tmp_path / "checkpoint_11").mkdir()  # being written: no `checkpoint` yet
  assert find_checkpoint_dir(str(tmp_path)) == str(tmp_path / "checkpoint_10")
  assert find_checkpoint_dir(str(tmp_path / "checkpoint_2")) == str(
      tmp_path / "checkpoint_2")


def test_safetensors_shards_stay_under_the_limit_and_the_index_sums_every_byte(
    tmp_path):
  """Three 400-byte tensors, shards of at most 1000 bytes: two shards (800 + 400),
  transformers' index naming each tensor's shard, total_size 1200."""
  tensors = [(f"t{i}", np.full((100,), i, np.float32)) for i in range(3)]
  files = write_safetensors(str(tmp_path), iter(tensors), max_shard_bytes=1000)
  first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
  assert files == [first, second, INDEX]
  index = json.loads((tmp_path / INDEX).read_text())
  assert index["metadata"]["total_size"] == 1200
  assert index["weight_map"] == {"t0": first, "t1": first, "t2": second}
  reader = SafetensorsReader(str(tmp_path))
  for name, array in tensors:
    np.testing.assert_array_equal(reader.read(name), array)
  # "At most" the limit: two tensors that fill a shard exactly share it, in the
  # first shard and in the next.
  four = tensors + [("t3", np.zeros((100,), np.float32))]
  said = []
  write_safetensors(str(tmp_path / "exact"), iter(four), max_shard_bytes=800,
                    progress=said.append)
  assert json.loads((tmp_path / "exact" / INDEX).read_text())["weight_map"] == {
      "t0": first, "t1": first, "t2": second, "t3": second}
  assert said == ["  wrote shard 1 (0 MiB)", "  wrote shard 2 (0 MiB)"]
  # Progress counts MiB: 2 MiB + 1 MiB tensors under a 2 MiB limit.
  said = []
  write_safetensors(str(tmp_path / "mib"), iter(
      [("a", np.zeros((2 << 20,), np.uint8)), ("b", np.zeros((1 << 20,), np.uint8))]),
                    max_shard_bytes=2 << 20, progress=said.append)
  assert said == ["  wrote shard 1 (2 MiB)", "  wrote shard 2 (1 MiB)"]
