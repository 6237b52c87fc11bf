"""openmoe-eval on tiny causal-LM and masked-diffusion runs."""
import json

import gin
import jax
import numpy as np
import pytest

from openmoe_jax import evaluate as evaluate_lib
from openmoe_jax import gin_utils, run_loader
from openmoe_jax.cli import evaluate as evaluate_cli
from openmoe_jax.cli import flags
from openmoe_jax.config import ModelConfig
from openmoe_jax.data import pipeline, vocabulary
from openmoe_jax.model import Decoder
from openmoe_jax.objectives import MaskedDiffusion
from openmoe_jax.trainer import train

TINY = ["ModelConfig.d_model = 32", "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 16",
        "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 2", "MoeConfig.num_experts = 4",
        "MoeConfig.group_size = 64", "SEQUENCE_LENGTH = 64", "BATCH_SIZE = 8",
        "train.eval_batches = 1", "adamw_warmup_cosine.warmup_steps = 1", "TRAIN_STEPS = 2"]


def _train(model_dir, *gin_files):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin", *gin_files],
                      TINY + [f"MODEL_DIR = '{model_dir}'"])
  train(print_fn=lambda *_: None)
  gin.clear_config()


def _numpy_cross_entropy(model_dir, num_batches):
  """Returns (CE per target token, target tokens) of the run's last checkpoint on
  the validation batches openmoe-eval reads: plain forward, NumPy log-softmax."""
  run = run_loader.load_run(str(model_dir))
  params = run_loader.restore_params(str(model_dir), run.steps[-1])
  forward = jax.jit(lambda p, b: Decoder(run.config).apply(
      {"params": p}, b["decoder_input_tokens"], positions_bt=b["decoder_positions"],
      segment_ids_bt=b["decoder_segment_ids"], attention_kind="causal", train=False)[0])
  total = count = 0.0
  for batch in pipeline.get_dataset(run.mixture_or_task_name, run.sequence_length,
                                    run.batch_size, split="validation", shuffle=False,
                                    repeat=False, num_batches=num_batches):
    x_btv = np.asarray(forward(params, batch), np.float64)
    x_btv -= x_btv.max(-1, keepdims=True)
    logp_btv = x_btv - np.log(np.exp(x_btv).sum(-1, keepdims=True))
    targets_bt = np.asarray(batch["decoder_target_tokens"])
    ce_bt = -np.take_along_axis(logp_btv, targets_bt[..., None], -1)[..., 0]
    weights_bt = np.asarray(batch["decoder_loss_weights"], np.float64)
    total += (ce_bt * weights_bt).sum()
    count += weights_bt.sum()
  gin.clear_config()
  return total / count, count


@pytest.mark.slow
def test_eval_causal_and_diffusion_runs(tmp_path, capsys):
  causal, dlm = tmp_path / "causal", tmp_path / "dlm"
  _train(causal)
  _train(dlm, "objectives/masked_diffusion.gin")
  capsys.readouterr()
  assert evaluate_cli.main([f"--model_dir={causal}", "--num_batches=2"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["objective"] == "CausalLm" and result["step"] == 2
  assert result["perplexity"] == pytest.approx(2.718281828 ** result["ce_loss"], rel=1e-6)
  expected_ce, expected_tokens = _numpy_cross_entropy(causal, 2)
  assert result["num_tokens"] == expected_tokens > 0
  np.testing.assert_allclose(result["ce_loss"], expected_ce, rtol=1e-6)
  args = [f"--model_dir={dlm}", "--num_batches=2", "--num_samples=3"]
  assert evaluate_cli.main(args) == 0
  first = json.loads(capsys.readouterr().out)
  assert first["objective"] == "MaskedDiffusion"
  assert first["stderr"] > 0 and first["perplexity_bound"] > 1
  assert first["perplexity_bound"] == pytest.approx(2.718281828 ** first["nelbo"], rel=1e-6)
  assert evaluate_cli.main(args) == 0
  assert json.loads(capsys.readouterr().out)["nelbo"] == first["nelbo"]  # fixed seeds


@pytest.mark.parametrize("bound,expected", [(0, 0), (11, 11), (None, 6)])
def test_eval_diffusion_uses_the_objective_mask_id(monkeypatch, capsys, bound, expected):
  gin_utils.import_configurables()
  gin.parse_config(["train.objective = @MaskedDiffusion()",
                    f"MaskedDiffusion.mask_id = {bound}"])
  run = run_loader.Run(model_dir="dir", config=ModelConfig(vocab_size=64),
                       mixture_or_task_name="task", sequence_length=16, batch_size=1,
                       steps=[3])
  monkeypatch.setattr(run_loader, "load_run", lambda model_dir: run)
  monkeypatch.setattr(run_loader, "restore_params", lambda model_dir, step: {})
  monkeypatch.setattr(pipeline, "get_dataset", lambda *args, **kwargs: [])
  monkeypatch.setattr(pipeline, "vocabulary_for", lambda name: object())
  monkeypatch.setattr(vocabulary, "mask_token_id", lambda vocab: 6)  # the `<mask>` id
  seen = []

  def fake_evaluate(model, params, batches, objective, mask_id, *args):
    seen.append(mask_id)
    return {"nelbo": 1.0}
  monkeypatch.setattr(evaluate_cli, "evaluate_diffusion", fake_evaluate)
  assert evaluate_cli.main(["--model_dir=dir"]) == 0
  assert seen == [expected]
  assert json.loads(capsys.readouterr().out)["objective"] == "MaskedDiffusion"


def test_causal_nll_is_weighted_by_each_batch_target_tokens(monkeypatch):
  # Per batch: (CE summed over its target tokens, target tokens). The NLL is the sum
  # of the first over the sum of the second, not the mean of the batches' means.
  sums = {0: (12.0, 4.0), 1: (20.0, 16.0)}  # means 3.0 and 1.25
  monkeypatch.setattr(evaluate_lib, "_compiled_causal_ce",
                      lambda model, kind: lambda params, batch: sums[int(batch["id"])])
  batches = [{"id": np.int32(0)}, {"id": np.int32(1)}]
  result = evaluate_lib.evaluate_causal(None, None, batches)
  assert result == {"nll": pytest.approx(32.0 / 20.0), "num_tokens": 20.0}
  with pytest.raises(ValueError, match="no target tokens"):
    evaluate_lib.evaluate_causal(None, None, [])


def test_diffusion_bound_weights_batches_by_tokens_and_adds_their_variances(monkeypatch):
  # Two batches with their own negative ELBO, standard error and target tokens; the
  # batches are independent, so the variance of the token-weighted mean is
  # sum (n_i se_i)^2 / N^2. Each batch gets its own mask draws (key seed + i).
  per_batch = [{"nelbo": 2.0, "stderr": 0.3, "num_tokens": 10.0},
               {"nelbo": 5.0, "stderr": 0.1, "num_tokens": 30.0}]
  keys = []

  def fake_elbo(model, params, batch, key, num_samples, mask_id, eps):
    keys.append(np.asarray(jax.random.key_data(key)).tolist())
    assert (num_samples, mask_id) == (7, 3)
    return per_batch[batch]
  monkeypatch.setattr(evaluate_lib, "diffusion_elbo", fake_elbo)
  objective = MaskedDiffusion()
  result = evaluate_lib.evaluate_diffusion(None, None, [0, 1], objective, mask_id=3,
                                           num_samples=7, seed=5)
  nelbo = (2.0 * 10 + 5.0 * 30) / 40
  assert result["nelbo"] == pytest.approx(nelbo)
  assert result["stderr"] == pytest.approx(np.hypot(10 * 0.3, 30 * 0.1) / 40)
  assert result["perplexity_bound"] == pytest.approx(np.exp(nelbo))
  assert (result["num_tokens"], result["num_samples"]) == (40.0, 7)
  expected_keys = [np.asarray(jax.random.key_data(jax.random.PRNGKey(s))).tolist()
                   for s in (5, 6)]
  assert keys == expected_keys
  with pytest.raises(ValueError, match="no target tokens"):
    evaluate_lib.evaluate_diffusion(None, None, [], objective, mask_id=3, num_samples=7)


def test_heldout_nll_takes_the_callers_mask_id_then_the_objectives_then_the_vocabs(
    monkeypatch):
  """heldout_nll's diffusion mask id: `mask_id` when given, else the objective's own
  (0 included), else the gin vocabulary's `<mask>`; 8 mask draws and seed 0 unless
  told otherwise."""
  seen = []

  def fake_evaluate(model, params, batches, objective, mask_id, num_samples, seed):
    seen.append((mask_id, num_samples, seed))
    return {"nelbo": 1.5, "stderr": 0.25, "num_tokens": 4.0}
  monkeypatch.setattr(evaluate_lib, "evaluate_diffusion", fake_evaluate)
  monkeypatch.setattr(evaluate_lib, "diffusion_mask_id", lambda: 77)
  nll = lambda objective, **kw: evaluate_lib.heldout_nll(None, None, [], objective, **kw)
  assert nll(MaskedDiffusion()) == {"nll": 1.5, "stderr": 0.25, "bound": True,
                                    "num_tokens": 4.0}
  nll(MaskedDiffusion(mask_id=5))
  nll(MaskedDiffusion(mask_id=0))
  nll(MaskedDiffusion(mask_id=5), mask_id=9, num_samples=2, seed=3)
  assert seen == [(77, 8, 0), (5, 8, 0), (0, 8, 0), (9, 2, 3)]


def test_eval_reads_the_runs_task_in_order_once_with_documented_defaults(
    monkeypatch, capsys):
  gin_utils.import_configurables()
  gin.parse_config(["train.objective = @MaskedDiffusion()"])
  run = run_loader.Run(model_dir="dir", config=ModelConfig(vocab_size=64),
                       mixture_or_task_name="task", sequence_length=16, batch_size=2,
                       steps=[3, 7])
  monkeypatch.setattr(run_loader, "load_run", lambda model_dir: run)
  monkeypatch.setattr(run_loader, "restore_params", lambda model_dir, step: {})
  monkeypatch.setattr(run_loader, "check_task", lambda name, flag: checked.append(
      (name, flag)))
  monkeypatch.setattr(run_loader, "check_split", lambda name, split: checked.append(
      (name, split)))
  monkeypatch.setattr(pipeline, "get_dataset", lambda *args, **kwargs: read.append(
      (args, kwargs)) or [])
  monkeypatch.setattr(pipeline, "vocabulary_for", lambda name: object())
  monkeypatch.setattr(vocabulary, "mask_token_id", lambda vocab: 6)
  monkeypatch.setattr(evaluate_cli, "evaluate_diffusion",
                      lambda model, params, batches, objective, mask_id, *rest:
                      drawn.append(rest) or {"nelbo": 1.0, "b": 2})
  checked, read, drawn = [], [], []
  assert evaluate_cli.main(["--model_dir=dir"]) == 0
  assert checked == [("task", "validation")]  # the run's own task needs no check
  assert read == [(("task", 16, 2), {"split": "validation", "shuffle": False,
                                     "repeat": False, "num_batches": 8})]
  assert drawn == [(16, 0)]  # ELBO draws, seed
  out = capsys.readouterr().out
  assert out == json.dumps({"b": 2, "nelbo": 1.0, "objective": "MaskedDiffusion",
                            "step": 7, "task": "task"}) + "\n"  # sorted keys
  checked, read, drawn = [], [], []
  assert evaluate_cli.main(["--model_dir=dir", "--task=other", "--split=train",
                            "--num_batches=1", "--num_samples=1", "--seed=5",
                            "--step=3"]) == 0
  assert checked == [("other", "--task"), ("other", "train")]
  assert read[0][0] == ("other", 16, 2) and read[0][1]["num_batches"] == 1
  assert drawn == [(1, 5)]
  assert json.loads(capsys.readouterr().out)["step"] == 3


def test_eval_flag_bounds():
  parse = lambda *flags_: evaluate_cli.PROGRAM.parse(["--model_dir=d", *flags_])[0]
  args = parse("--num_batches=1", "--num_samples=1", "--step=0")
  assert (args.num_batches, args.num_samples, args.step) == (1, 1, 0)
  assert parse().task is None and parse().step is None
  for bad in ("--num_batches=0", "--num_samples=0", "--step=-1"):
    with pytest.raises(flags.UsageError):
      parse(bad)
  with pytest.raises(flags.UsageError, match="--model_dir"):
    evaluate_cli.PROGRAM.parse([])
