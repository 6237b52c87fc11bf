"""The double-win study (openmoe-ablate --study=double_win): the held-out NLL of both
objectives on models whose NLL is known, the arms' equal activated parameters, the
data subset, the report's arithmetic on hand-made curves, and a tiny study end to
end."""
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import errors
from openmoe_jax.cli import ablate as ablate_cli
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.evaluate import heldout_nll
from openmoe_jax.model import Decoder
from openmoe_jax.objectives import CausalLm, MaskedDiffusion
from openmoe_jax.studies import double_win, double_win_data, double_win_report
from openmoe_jax.studies.double_win_data import MAX_DOCUMENT_TOKENS, select_documents

VOCAB = 64
MASK_ID = 3
DENSE = ModelConfig(vocab_size=VOCAB, d_model=16, num_heads=2, head_dim=8, d_ff=32,
                    num_layers=2, layer_pattern="DD")
MOE = DENSE.replace(layer_pattern="MM", moe=MoeConfig(
    num_experts=4, top_k=2, expert_d_ff=16, group_size=16, residual_mlp=False))


def _batches(seed=0, num=2, b=3, t=16):
  """Packed-looking batches: two segments per row, the tail of row 0 padding."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    targets = rng.integers(4, VOCAB, (b, t)).astype(np.int32)
    inputs = np.concatenate([np.zeros((b, 1), np.int32), targets[:, :-1]], axis=1)
    segments = np.where(np.arange(t) < t // 2, 1, 2)[None].repeat(b, 0).astype(np.int32)
    positions = np.where(segments == 1, np.arange(t), np.arange(t) - t // 2)
    weights = np.ones((b, t), np.int32)
    weights[0, -5:] = 0
    segments[0, -5:] = 0
    out.append({"decoder_input_tokens": inputs, "decoder_target_tokens": targets,
                "decoder_loss_weights": weights, "decoder_segment_ids": segments,
                "decoder_positions": positions.astype(np.int32)})
  return out


def _params(cfg, zero=False):
  params = nn.unbox(Decoder(cfg).init(jax.random.PRNGKey(1),
                                      jnp.zeros((1, 16), jnp.int32)))["params"]
  return jax.tree.map(jnp.zeros_like, params) if zero else params


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_uniform_predictions_give_log_v_for_both_objectives(cfg):
  # All-zero weights: every logit is 0, the prediction is uniform over the model's
  # vocabulary, so the NLL is log V whatever the tokens, exactly for AR and for
  # every mask draw of the diffusion bound (LLaDA's estimator weighs l masked
  # tokens by L / l).
  params, batches = _params(cfg, zero=True), _batches()
  ar = heldout_nll(Decoder(cfg), params, batches, CausalLm())
  dlm = heldout_nll(Decoder(cfg), params, batches, MaskedDiffusion(mask_id=MASK_ID),
                    num_samples=3)
  real_tokens = sum(int(b["decoder_loss_weights"].sum()) for b in batches)
  assert ar["num_tokens"] == dlm["num_tokens"] == real_tokens
  assert ar["nll"] == pytest.approx(math.log(VOCAB), abs=1e-5)
  assert dlm["nll"] == pytest.approx(math.log(VOCAB), abs=1e-5)
  assert (ar["bound"], dlm["bound"]) == (False, True)
  assert ar["stderr"] == 0.0 and dlm["stderr"] < 1e-5


def _numpy_causal_nll(cfg, params, batches, train):
  """Returns the token-weighted NLL of the targets under a NumPy log-softmax of the
  decoder's logits (routing as in training when `train`)."""
  total = count = 0.0
  for batch in batches:
    logits, _ = Decoder(cfg).apply(
        {"params": params}, batch["decoder_input_tokens"],
        positions_bt=batch["decoder_positions"],
        segment_ids_bt=batch["decoder_segment_ids"], attention_kind="causal",
        train=train, rngs={"jitter": jax.random.PRNGKey(0)})
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, batch["decoder_target_tokens"][..., None], -1)[..., 0]
    total -= (picked * batch["decoder_loss_weights"]).sum()
    count += batch["decoder_loss_weights"].sum()
  return total / count


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_causal_nll_equals_a_numpy_log_softmax_of_the_logits(cfg):
  params, batches = _params(cfg), _batches(seed=3)
  result = heldout_nll(Decoder(cfg), params, batches, CausalLm())
  assert result["nll"] == pytest.approx(_numpy_causal_nll(cfg, params, batches, False),
                                        rel=1e-5)
  assert result["nll"] != pytest.approx(math.log(VOCAB), abs=1e-3)  # not trivial
  if cfg is MOE:  # routed as in evaluation: training's capacity would drop tokens
    assert result["nll"] != pytest.approx(
        _numpy_causal_nll(cfg, params, batches, True), rel=1e-4)


def test_the_diffusion_bound_sees_the_model_and_is_reproducible():
  params, batches = _params(DENSE), _batches(seed=4)
  objective = MaskedDiffusion(mask_id=MASK_ID)
  one = heldout_nll(Decoder(DENSE), params, batches, objective, num_samples=4)
  two = heldout_nll(Decoder(DENSE), params, batches, objective, num_samples=4)
  assert one == two
  assert one["stderr"] > 0
  assert abs(one["nll"] - math.log(VOCAB)) > 3 * one["stderr"]


def test_document_subset_hits_the_target_and_balances_the_sources():
  words = lambda text: text.split()
  docs = {"code": [{"id": f"c{i}", "text": " ".join(["x"] * 300)} for i in range(20)],
          "text": [{"id": f"t{i}", "text": " ".join(["y"] * 50)} for i in range(200)]}
  picked = select_documents(docs, 2000, words, lambda ids: " ".join(ids), seed=0)
  per_source = {s: sum(len(d["text"].split()) for d in picked if d["source"] == s)
                for s in ("code", "text")}
  assert sum(per_source.values()) == 2000
  assert abs(per_source["code"] - per_source["text"]) <= 300
  assert len({d["id"] for d in picked}) == len(picked)
  assert picked == select_documents(docs, 2000, words, lambda ids: " ".join(ids), 0)
  long_doc = {"code": [{"id": "big", "text": " ".join(["z"] * 5000)}]}
  with pytest.raises(ValueError, match="holds only"):
    select_documents(long_doc, 100000, words, lambda ids: " ".join(ids))
  one = select_documents(long_doc, 1000, words, lambda ids: " ".join(ids))
  assert len(one[0]["text"].split()) == 1000  # cut to the target
  assert MAX_DOCUMENT_TOKENS < 5000
  with pytest.raises(ValueError, match=f"holds only {MAX_DOCUMENT_TOKENS} tokens"):
    select_documents(long_doc, 3000, words, lambda ids: " ".join(ids))


def test_the_arms_have_equal_activated_parameters():
  counts = double_win.parameter_counts(double_win.StudySettings())
  dense, moe = counts["dense"], counts["moe"]
  # tiny_base.gin: 4 layers, d_model 128; the MoE has 16 experts of d_ff 128, top 4
  # (active width 512 = the dense d_ff); its routers add 4 x 128 x 16 weights.
  assert moe["router"] == 4 * 128 * 16 and dense["router"] == 0
  assert moe["activated"] - moe["router"] == dense["activated"]
  assert moe["total"] - dense["total"] == 4 * (16 - 4) * 3 * 128 * 128 + moe["router"]
  with pytest.raises(errors.InputError, match="same activated parameters"):
    double_win.parameter_counts(double_win.StudySettings(
        bindings=("MoeConfig.top_k = 2",)))


def _curve(nll, stderr=0.0, bound=False, epochs_per_point=2.0):
  return [{"step": 10 * (i + 1), "epochs": epochs_per_point * (i + 1), "nll": v,
           "stderr": stderr, "bound": bound} for i, v in enumerate(nll)]


def _results(ar_dense, dlm_dense, ar_moe, dlm_moe, se=0.01):
  arms = {}
  for name, nll in (("ar_dense", ar_dense), ("dlm_dense", dlm_dense),
                    ("ar_moe", ar_moe), ("dlm_moe", dlm_moe)):
    objective, model = name.split("_")
    arms[name] = {"objective": objective, "model": model, "tokens_per_sec": 100.0,
                  "curve": _curve(nll, se if objective == "dlm" else 0.0,
                                  objective == "dlm")}
  return {"arms": arms, "parameters": {"dense": {"activated": 10, "router": 0},
                                       "moe": {"activated": 12, "router": 2}}}


def test_gains_crossover_and_answers_on_hand_made_curves():
  results = _results(ar_dense=[5.0, 4.6, 4.7, 4.9], dlm_dense=[5.6, 4.9, 4.65, 4.5],
                     ar_moe=[4.9, 4.5, 4.6, 4.8], dlm_moe=[5.4, 4.6, 4.3, 4.1])
  g = double_win_report.gains(results)
  # Final: AR 4.9 - 4.8 = 0.1, DLM 4.5 - 4.1 = 0.4, difference 0.3.
  assert g["final"]["ar"]["gain"] == pytest.approx(0.1)
  assert g["final"]["dlm"]["gain"] == pytest.approx(0.4)
  assert g["final"]["difference"]["value"] == pytest.approx(0.3)
  assert g["final"]["difference"]["stderr"] == pytest.approx(math.sqrt(2) * 0.01)
  # Best: AR 4.6 - 4.5 = 0.1, DLM 4.5 - 4.1 = 0.4.
  assert g["best"]["ar"]["gain"] == pytest.approx(0.1)
  # Dense: DLM 4.65 < AR 4.7 at epoch 6 by 0.05 > 2 x 0.01, and after: crossover
  # between epochs 4 and 6. MoE: DLM ahead from epoch 6 (4.3 < 4.6).
  dense = double_win_report.crossover(results, "dense")
  assert (dense["previous_epoch"], dense["epoch"]) == (4.0, 6.0)
  assert double_win_report.crossover(results, "moe")["epoch"] == 6.0
  turn = double_win_report.ar_turn_up(results["arms"]["ar_dense"])
  assert (turn["best_epoch"], turn["rise"]) == (4.0, pytest.approx(0.3))
  text = "\n".join(double_win_report.answers(results))
  assert "(a) MoE helps DLM more than AR (final checkpoints): yes" in text
  assert "(b) dense: DLM beats AR between epoch 4.0 and 6.0" in text
  assert "AR dense validation NLL turns up" in text
  # Best against best: AR dense 4.6 (epoch 4) vs DLM dense 4.5 (epoch 8).
  assert ("(b) dense, best against best (AR with early stopping): AR 4.6000 at epoch "
          "4.0, DLM bound 4.5000 ± 0.0100 at epoch 8.0: DLM lower by 0.1000") in text
  # Within noise: no claim either way; never ahead: no crossover.
  close = _results([5.0, 4.0], [5.5, 4.5], [4.9, 3.9], [5.4, 4.41], se=0.05)
  text = "\n".join(double_win_report.answers(close))
  assert "not distinguishable from equal" in text
  assert "(b) dense: no crossover within 4.0 epochs" in text


def test_study_flags_are_checked(capsys):
  assert ablate_cli.main(["--unique_tokens=100"]) == 2
  assert "--unique_tokens needs --study" in capsys.readouterr().err
  assert ablate_cli.main(["--study=double_win", "--arms=dense"]) == 2
  assert "--study takes no --arms" in capsys.readouterr().err
  assert ablate_cli.main(["--study=double_wins"]) == 2


@pytest.mark.slow
def test_a_tiny_study_writes_the_table_the_plot_and_the_json(tmp_path, capsys):
  output = tmp_path / "study"
  argv = ["--study=double_win", "--steps=4", "--unique_tokens=3000",
          "--validation_tokens=1024", "--eval_points=2", "--dlm_samples=2",
          f"--output={output}", "--gin.ModelConfig.d_model=64",
          "--gin.MoeConfig.num_experts=8", "--gin.BATCH_SIZE=8",
          "--gin.SEQUENCE_LENGTH=64", "--gin.train.eval_batches=1",
          # One device: this test is about the study's outputs. On the 8 emulated
          # CPU devices XLA's collectives rendezvous sometimes timed out here (an
          # all-reduce waiting 40 s for one device thread, then abort); sharded
          # training is tested in test_sharded_training.py.
          "--gin.train.num_devices=1"]
  assert ablate_cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "ar_dense" in out and "dlm_moe" in out and "(a) MoE helps DLM" in out
  for name in ("report.md", "double_win.png", "double_win.json"):
    assert os.path.getsize(output / name) > 0
  results = json.loads((output / "double_win.json").read_text())
  assert set(results["arms"]) == {"ar_dense", "dlm_dense", "ar_moe", "dlm_moe"}
  for name, arm in results["arms"].items():
    assert [row["step"] for row in arm["curve"]] == [2, 4]
    assert [row["bound"] for row in arm["curve"]] == [name.startswith("dlm")] * 2
    assert all(math.isfinite(row["nll"]) for row in arm["curve"])
  # 4 steps x 8 rows over the measured rows of the unique tokens.
  epochs = results["arms"]["ar_dense"]["curve"][-1]["epochs"]
  assert epochs == pytest.approx(4 * 8 / results["data"]["train_rows"])
  assert len(results["arms"]["ar_moe"]["routing"]["mean_to_final"]) == 2
  assert results["arms"]["ar_moe"]["routing"]["mean_to_final"][-1] == pytest.approx(1.0)
  assert len(results["summary"]["answers"]) >= 4
  # The same line again resumes: nothing is retrained, the numbers are the same.
  assert ablate_cli.main(argv) == 0
  again = json.loads((output / "double_win.json").read_text())
  assert again["arms"]["dlm_moe"]["curve"] == results["arms"]["dlm_moe"]["curve"]


def test_a_dlm_ahead_from_the_first_checkpoint_has_no_previous_epoch():
  """DLM below AR by more than 2 standard errors at every scored checkpoint: the
  crossover is the first checkpoint (epoch 2), with no checkpoint before it."""
  results = _results(ar_dense=[5.0, 4.8, 4.7], dlm_dense=[4.5, 4.4, 4.3],
                     ar_moe=[5.0, 4.8, 4.7], dlm_moe=[5.5, 5.4, 5.3])
  dense = double_win_report.crossover(results, "dense")
  assert (dense["previous_epoch"], dense["epoch"]) == (None, 2.0)
  text = "\n".join(double_win_report.answers(results))
  assert "(b) dense: DLM beats AR from the first scored checkpoint" in text


def test_count_tokens_counts_loss_tokens_and_the_rows_holding_any():
  """Two batches [3, 5]: 4 + 2 loss tokens in rows 0 and 2 of the first (row 1 is
  all padding), 1 in row 1 of the second: 7 tokens in 3 rows."""
  first_bt = np.array([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]], np.float32)
  second_bt = np.zeros((3, 5), np.float32)
  second_bt[1, 4] = 1.0
  counts = double_win_data.count_tokens([{"decoder_loss_weights": first_bt},
                                         {"decoder_loss_weights": second_bt}])
  assert counts == {"tokens": 7, "rows": 3}
