"""Autoregressive sampling, serving routing and the openmoe-sample command."""
import functools
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import gin_utils, run_loader
from openmoe_jax.cli import flags
from openmoe_jax.cli import sample as sample_cli
from openmoe_jax.data import pipeline, vocabulary
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
from openmoe_jax.decoding import autoregressive
from openmoe_jax.decoding.diffusion import sample_diffusion
from openmoe_jax.decoding.serving import serving_config
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.trainer import train

CFG = ModelConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8, d_ff=24,
                  num_layers=2, sparse_interval=2,
                  moe=MoeConfig(num_experts=4, group_size=4096, capacity_factor_eval=0.5,
                                min_capacity=1, router_init_std=1.0))


def _params():
  return nn.unbox(Decoder(CFG).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))[
      "params"]


def test_greedy_equals_growing_the_prompt_one_token_at_a_time():
  params, model = _params(), Decoder(serving_config(CFG, diffusion=False))
  got = autoregressive.sample_autoregressive(model, params, [5, 9, 3], max_new_tokens=6,
                                     kv_cache=False)
  tokens = [5, 9, 3]
  # Jitted: op by op, these six forwards took 4 minutes on a slow 2-core CPU.
  forward = jax.jit(lambda t: model.apply({"params": params}, t, train=False))
  for _ in range(6):  # exact-length inputs: no padding after the cursor at all
    logits, _ = forward(jnp.asarray([tokens]))
    tokens.append(int(jnp.argmax(logits[0, -1])))
  assert got.tolist() == tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_cache_sampler_equals_the_sampler_without_cache(temperature):
  params, model = _params(), Decoder(serving_config(CFG, diffusion=False))
  run = lambda cache: autoregressive.sample_autoregressive(
      model, params, [5, 9, 3, 7], max_new_tokens=7, temperature=temperature,
      top_p=0.95, rng=jax.random.PRNGKey(2), kv_cache=cache).tolist()
  assert run(True) == run(False)
  assert len(run(True)) == 11


def test_serving_config_token_choice_is_dropless_only_when_autoregressive():
  assert serving_config(CFG, diffusion=False).moe.capacity_factor_eval == 4.0
  assert serving_config(CFG, diffusion=True).moe.capacity_factor_eval == 0.5


class _Calls:
  """A list holder (flax turns list attributes into tuples)."""

  def __init__(self):
    self.items = []


class _RecordRouting(nn.Module):
  """Runs `inner` and records each call's experts per token (mean, per MoE layer)."""

  inner: nn.Module
  calls: Any

  def __call__(self, tokens_bt, **kwargs):
    logits_btv, aux = self.inner(tokens_bt, **kwargs)
    jax.debug.callback(lambda e_l: self.calls.items.append(np.asarray(e_l)),
                       aux["experts_per_token_mean"])
    return logits_btv, aux


def test_diffusion_sampling_with_expert_choice_routes_as_evaluation():
  # E 8, k 2, eval cf 1: each expert takes C = 1 * 2 * 16 / 8 = 4 of the 16 tokens,
  # 2.0 experts per token (a capacity factor of E would give C = 16: 8.0).
  cfg = CFG.replace(moe=CFG.moe.replace(num_experts=8, top_k=2, capacity_factor_eval=1.0,
                                        router=ExpertChoiceRouter()))
  params = nn.unbox(jax.jit(Decoder(cfg).init)(jax.random.PRNGKey(0),
                                               jnp.zeros((1, 16), jnp.int32)))["params"]
  prompt_1p, mask_id = np.asarray([[5, 9, 3, 7]]), 63
  x_1t = jnp.asarray(np.concatenate([prompt_1p, np.full((1, 12), mask_id)], 1))
  _, aux = jax.jit(functools.partial(Decoder(cfg).apply, attention_kind="bidirectional",
                                     train=False))({"params": params}, x_1t)
  eval_l = np.asarray(aux["experts_per_token_mean"])
  np.testing.assert_allclose(eval_l, [2.0])
  calls = _Calls()
  model = _RecordRouting(Decoder(serving_config(cfg, diffusion=True)), calls)
  sample_diffusion(model, {"inner": params}, prompt_1p, gen_length=12, steps=3,
                   mask_id=mask_id)
  assert len(calls.items) == 3  # one model call per step
  np.testing.assert_allclose(np.stack(calls.items), np.stack([eval_l] * 3))


def test_top_p_keeps_the_nucleus_and_sampling_is_seeded():
  logits = jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05]))
  kept = np.isfinite(np.asarray(autoregressive.filter_top_p(logits, 0.7)))
  assert kept.tolist() == [True, True, False, False]
  assert np.isfinite(np.asarray(autoregressive.filter_top_p(logits, 0.01))).sum() == 1
  params, model = _params(), Decoder(serving_config(CFG, diffusion=False))
  run = lambda seed: autoregressive.sample_autoregressive(
      model, params, [1, 2], max_new_tokens=8, temperature=1.0, top_p=0.9,
      rng=jax.random.PRNGKey(seed), vocab_limit=60).tolist()
  assert run(3) == run(3)
  assert all(t < 60 for t in run(4))


def test_top_p_keeps_the_nucleus_of_unsorted_logits():
  """The nucleus is found in sorted order but applied to the tokens' own ids: with
  probabilities (0.05, 0.3, 0.5, 0.15) and top_p 0.7 the kept ids are 2 (0.5) and
  1 (0.3), whose mass before each is 0 and 0.5 (< 0.7)."""
  logits = jnp.log(jnp.asarray([0.05, 0.3, 0.5, 0.15]))
  filtered = np.asarray(autoregressive.filter_top_p(logits, 0.7))
  np.testing.assert_array_equal(filtered, [-np.inf, logits[1], logits[2], -np.inf])


def test_top_p_sampling_draws_from_the_nucleus_only():
  """Probabilities (0.05, 0.3, 0.5, 0.15), top_p 0.7: 64 draws at temperature 1 are
  ids 1 and 2 only, both of them, in about their renormalised shares (3:5)."""
  model = _fixed_logits_stub(jnp.log(jnp.asarray([0.05, 0.3, 0.5, 0.15])))
  ids = autoregressive.sample_autoregressive(
      model, {}, [0], max_new_tokens=64, temperature=1.0, top_p=0.7,
      rng=jax.random.PRNGKey(0), kv_cache=False)[1:]
  counts = np.bincount(ids, minlength=4)
  assert counts[0] == counts[3] == 0 and 12 <= counts[1] <= 36, counts


class _StubLM:
  """A stand-in for Decoder with `apply`'s calling conventions (cache collection
  included) whose logits at every position are `logits_fn(positions_bt)` [b, t, V];
  without `positions_bt` the positions are 0, 1, ..., t - 1."""

  def __init__(self, logits_fn):
    self.logits_fn = logits_fn

  def apply(self, variables, tokens_bt, positions_bt=None, train=False, mutable=False):
    del variables, train
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    out = (self.logits_fn(positions_bt), None)
    return (out, {"cache": {"unused": jnp.zeros((), jnp.int32)}}) if mutable else out


def _next_position_stub(vocab=16):
  """Returns a stub whose greedy choice is (position of the last token read) + 1."""
  return _StubLM(lambda pos_bt: 10.0 * jax.nn.one_hot((pos_bt + 1) % vocab, vocab))


def _fixed_logits_stub(logits_v):
  """Returns a stub whose logits are `logits_v` [V] at every position."""
  return _StubLM(lambda pos_bt: jnp.broadcast_to(logits_v, pos_bt.shape + logits_v.shape))


def test_decoded_tokens_get_their_positions_with_and_without_the_kv_cache():
  """The i-th token of the output sits at position i: a stub whose greedy choice
  is (position of the last token read) + 1 must write 3, 4, 5, ... after a
  3-token prompt, with the KV cache (prefill at 0, then one token per step at
  len(out) - 1) as without it."""
  for cache in (True, False):
    got = autoregressive.sample_autoregressive(_next_position_stub(), {}, [7, 7, 7],
                                               max_new_tokens=6, kv_cache=cache)
    assert got.tolist() == [7, 7, 7, 3, 4, 5, 6, 7, 8], cache


def test_an_empty_prompt_starts_from_id_0_as_seqio_decoder_inputs_do():
  for cache in (True, False):
    got = autoregressive.sample_autoregressive(_next_position_stub(), {}, [],
                                               max_new_tokens=3, kv_cache=cache)
    assert got.tolist() == [0, 1, 2, 3], cache


def test_decoded_tokens_stop_after_the_eos_id():
  """Decoding stops right after writing eos_id, which stays in the output: the
  stub writes 3, 4, 5, ... after a 3-token prompt, so eos_id 5 ends it there."""
  for cache in (True, False):
    got = autoregressive.sample_autoregressive(_next_position_stub(), {}, [7, 7, 7],
                                               max_new_tokens=8, eos_id=5,
                                               kv_cache=cache)
    assert got.tolist() == [7, 7, 7, 3, 4, 5], cache


def test_temperature_divides_the_logits():
  """Sampling at temperature T draws token i with probability p_i^(1/T) / sum:
  for p = (0.5, 0.3, 0.2) and T = 0.5 that is (0.658, 0.237, 0.105) (T = 1 would
  give p itself; multiplying by T, (0.415, 0.322, 0.263))."""
  p = np.array([0.5, 0.3, 0.2])
  logits_v = jnp.log(jnp.asarray(p, jnp.float32))
  model = _fixed_logits_stub(logits_v)
  n = 1200
  got = autoregressive.sample_autoregressive(model, {}, [0], max_new_tokens=n,
                                             temperature=0.5, rng=jax.random.PRNGKey(4))
  share = np.bincount(got[1:], minlength=3) / n
  want = p ** 2 / np.sum(p ** 2)
  np.testing.assert_allclose(share, want, atol=0.05)


def test_vocab_limit_excludes_the_limit_itself():
  """Ids >= vocab_limit are never chosen: with the largest logit on id 3 and
  vocab_limit 3, greedy decoding picks id 2, the best of 0, 1, 2."""
  logits_v = jnp.asarray([0.0, 1.0, 2.0, 9.0, 5.0])
  model = _fixed_logits_stub(logits_v)
  for cache in (True, False):
    got = autoregressive.sample_autoregressive(model, {}, [1], max_new_tokens=3,
                                               vocab_limit=3, kv_cache=cache)
    assert got.tolist() == [1, 2, 2, 2], cache


class _Vocab:
  """The few vocabulary members openmoe-sample reads."""

  eos_id, vocab_size = 1, 64

  def encode(self, text):
    return [10 + ord(c) % 40 for c in text]

  def decode(self, ids):
    return "".join(chr(65 + i % 26) for i in ids)


@pytest.mark.parametrize("bound,expected", [(0, 0), (11, 11), (None, 6)])
def test_cli_diffusion_uses_the_objective_mask_id(monkeypatch, capsys, bound, expected):
  gin_utils.import_configurables()
  gin.parse_config(["train.objective = @MaskedDiffusion()",
                    f"MaskedDiffusion.mask_id = {bound}"])
  run = run_loader.Run(model_dir="dir", config=CFG, mixture_or_task_name="task",
                       sequence_length=16, batch_size=1, steps=[3])
  monkeypatch.setattr(run_loader, "load_run", lambda model_dir: run)
  monkeypatch.setattr(run_loader, "restore_params", lambda model_dir, step: {})
  monkeypatch.setattr(pipeline, "vocabulary_for", lambda name: _Vocab())
  monkeypatch.setattr(vocabulary, "mask_token_id", lambda vocab: 6)  # the `<mask>` id
  seen = {}

  def fake_sample(model, params, prompt_ids, **kwargs):
    seen.update(kwargs)
    return np.full((1, len(prompt_ids) + kwargs["gen_length"]), 12, np.int32)
  monkeypatch.setattr(sample_cli, "sample_diffusion", fake_sample)
  assert sample_cli.main(["--model_dir=dir", "--prompt=ab", "--max_new_tokens=4"]) == 0
  assert seen["mask_id"] == expected
  assert capsys.readouterr().out == "abMMMM\n"


def test_cli_autoregressive_prompt_starts_with_token_0(monkeypatch, capsys):
  """Training inputs are targets shifted right behind a 0 (seqio; OpenMoE's BOS), so
  the CLI must decode from [0] + prompt and print only what follows it."""
  gin_utils.import_configurables()
  run = run_loader.Run(model_dir="dir", config=CFG, mixture_or_task_name="task",
                       sequence_length=16, batch_size=1, steps=[3])
  monkeypatch.setattr(run_loader, "load_run", lambda model_dir: run)
  monkeypatch.setattr(run_loader, "restore_params", lambda model_dir, step: {})
  monkeypatch.setattr(pipeline, "vocabulary_for", lambda name: _Vocab())
  seen = []

  def fake_sample(model, params, prompt_ids, **kwargs):
    seen.append(list(prompt_ids))
    return np.asarray(list(prompt_ids) + [2, 3], np.int32)
  monkeypatch.setattr(sample_cli, "sample_autoregressive", fake_sample)
  assert sample_cli.main(["--model_dir=dir", "--prompt=ab", "--mode=ar"]) == 0
  assert seen == [[0] + _Vocab().encode("ab")]
  assert capsys.readouterr().out == "abCD\n"
  # What follows the EOS id is not printed (the sampler stops there; a fake one may not).
  monkeypatch.setattr(sample_cli, "sample_autoregressive", lambda model, params, ids, **k:
                      np.asarray(list(ids) + [2, _Vocab.eos_id, 3], np.int32))
  assert sample_cli.main(["--model_dir=dir", "--prompt=ab", "--mode=ar"]) == 0
  assert capsys.readouterr().out == "abC\n"


@pytest.mark.slow
def test_cli_samples_from_a_trained_run(tmp_path, capsys):
  model_dir = tmp_path / "run"
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin"], [
      "ModelConfig.d_model = 32", "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 16",
      "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 2", "MoeConfig.num_experts = 4",
      "MoeConfig.group_size = 64", "SEQUENCE_LENGTH = 64", "BATCH_SIZE = 8",
      "train.eval_batches = 1", "adamw_warmup_cosine.warmup_steps = 1",
      f"MODEL_DIR = '{model_dir}'", "TRAIN_STEPS = 2"])
  train(print_fn=lambda *_: None)
  gin.clear_config()
  capsys.readouterr()
  for mode in ("ar", "diffusion"):
    assert sample_cli.main([f"--model_dir={model_dir}", "--prompt=def ", f"--mode={mode}",
                        "--max_new_tokens=8", "--steps=4"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def _fake_run(monkeypatch, objective=None):
  """A run of CFG on task "task" whose checkpoint and vocabulary are stubs; binds
  train.objective to `objective` (a gin reference) when given."""
  gin_utils.import_configurables()
  if objective:
    gin.parse_config([f"train.objective = {objective}"])
  run = run_loader.Run(model_dir="dir", config=CFG, mixture_or_task_name="task",
                       sequence_length=16, batch_size=1, steps=[3])
  monkeypatch.setattr(run_loader, "load_run", lambda model_dir: run)
  monkeypatch.setattr(run_loader, "restore_params", lambda model_dir, step: {})
  monkeypatch.setattr(pipeline, "vocabulary_for", lambda name: _Vocab())
  monkeypatch.setattr(vocabulary, "mask_token_id", lambda vocab: 6)
  calls = []

  def fake(kind):
    def sample(model, params, prompt_ids, **kwargs):
      calls.append((kind, list(prompt_ids), kwargs))
      new = kwargs.get("gen_length", kwargs.get("max_new_tokens"))
      return np.asarray(list(prompt_ids) + [2] * new, np.int32)
    return sample
  monkeypatch.setattr(sample_cli, "sample_autoregressive", fake("ar"))
  monkeypatch.setattr(sample_cli, "sample_diffusion", lambda *a, **k: fake("diffusion")(
      *a, **k)[None])
  return calls


def test_cli_mode_overrides_the_runs_objective_and_defaults_are_documented(monkeypatch):
  calls = _fake_run(monkeypatch, "@MaskedDiffusion()")
  assert sample_cli.main(["--model_dir=dir", "--prompt=ab", "--mode=ar"]) == 0
  kind, prompt, kwargs = calls.pop()
  assert (kind, prompt) == ("ar", [0] + _Vocab().encode("ab"))
  assert (kwargs["max_new_tokens"], kwargs["temperature"], kwargs["top_p"],
          kwargs["eos_id"], kwargs["vocab_limit"]) == (64, 0.0, 1.0, 1, 64)
  assert np.array_equal(kwargs["rng"], jax.random.PRNGKey(0))
  assert sample_cli.main(["--model_dir=dir", "--prompt=ab"]) == 0  # auto: diffusion
  kind, prompt, kwargs = calls.pop()
  assert (kind, prompt) == ("diffusion", _Vocab().encode("ab"))  # no start token
  assert (kwargs["gen_length"], kwargs["steps"], kwargs["block_length"],
          kwargs["remasking"], kwargs["temperature"]) == (64, 32, None,
                                                          "low_confidence", 0.0)
  # An empty prompt: the diffusion sampler needs one position to condition on.
  assert sample_cli.main(["--model_dir=dir", "--prompt=", "--steps=1",
                          "--block_length=1", "--max_new_tokens=1", "--seed=3",
                          "--remasking=random", "--temperature=0.5"]) == 0
  kind, prompt, kwargs = calls.pop()
  assert (kind, prompt) == ("diffusion", [0])
  assert (kwargs["gen_length"], kwargs["steps"], kwargs["block_length"],
          kwargs["remasking"], kwargs["temperature"]) == (1, 1, 1, "random", 0.5)
  assert np.array_equal(kwargs["rng"], jax.random.PRNGKey(3))


def test_cli_flag_bounds():
  parse = lambda *flags_: sample_cli.PROGRAM.parse(["--model_dir=d", *flags_])[0]
  args = parse("--step=0", "--max_new_tokens=1", "--steps=1", "--block_length=1",
               "--temperature=0", "--top_p=1")
  assert (args.step, args.max_new_tokens, args.steps, args.block_length,
          args.temperature, args.top_p) == (0, 1, 1, 1, 0.0, 1.0)
  assert parse("--temperature=0.5", "--top_p=0.5").top_p == 0.5
  assert parse().step is None and parse().mode == "auto" and parse().prompt == ""
  for bad in ("--step=-1", "--max_new_tokens=0", "--steps=0", "--block_length=0",
              "--temperature=-0.1", "--top_p=0", "--top_p=1.5"):
    with pytest.raises(flags.UsageError):
      parse(bad)
  with pytest.raises(flags.UsageError, match="--model_dir"):
    sample_cli.PROGRAM.parse([])
