"""The double-win study (openmoe-ablate --study=double_win): the held-out NLL of both
objectives on models whose NLL is known, the arms' equal activated parameters, the
data subset, the report's arithmetic on hand-made curves, and a tiny study end to
end."""
import json
import math
import os

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from openmoe_jax import errors, gin_utils
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


def test_a_verdict_needs_more_than_two_standard_errors_of_its_own_sign():
  verdict = lambda v, se: double_win_report._verdict(v, se, "yes", "no", "neither")  # pylint: disable=protected-access
  assert [verdict(v, 0.125) for v in (0.5, 0.25, 0.125, 0.0, -0.125, -0.25, -0.5)] == [
      "yes", "neither", "neither", "neither", "neither", "neither", "no"]
  assert [verdict(v, 0.0) for v in (0.25, 0.0, -0.25)] == ["yes", "neither", "no"]


def test_a_gap_of_exactly_two_standard_errors_is_no_crossover_and_a_flat_end_no_turn():
  """AR - DLM of exactly 2 x 0.125 at the end is not "below"; the gaps hold AR -
  DLM per checkpoint; an AR curve that ends at its best has not turned up."""
  results = _results(ar_dense=[5.0, 4.5, 4.5], dlm_dense=[5.5, 4.5, 4.25],
                     ar_moe=[5.0, 4.5, 4.5], dlm_moe=[5.5, 4.5, 4.0], se=0.125)
  dense = double_win_report.crossover(results, "dense")
  assert dense["epoch"] is None
  assert dense["gaps"] == [{"epochs": 2.0, "ar_minus_dlm": -0.5, "stderr": 0.125},
                           {"epochs": 4.0, "ar_minus_dlm": 0.0, "stderr": 0.125},
                           {"epochs": 6.0, "ar_minus_dlm": 0.25, "stderr": 0.125}]
  assert double_win_report.crossover(results, "moe")["epoch"] == 6.0
  text = "\n".join(double_win_report.answers(results))
  assert ("(b) dense: no crossover within 6.0 epochs: at the end AR - DLM = +0.2500 "
          "nats/token (DLM bound ± 0.1250).") in text
  assert ("AR dense validation NLL does not turn up: best 4.5000 at epoch 4.0, final "
          "4.5000 at epoch 6.0 (+0.0000).") in text


class _CharVocab:
  """One id per character: token counts are character counts."""

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


def test_study_data_is_written_whole_and_read_in_one_ordered_packed_pass(tmp_path):
  """train.jsonl and validation.jsonl hold the asked-for tokens of disjoint corpus
  documents (no temporary file left; seed 0 by default); the bindings register
  them as the run's one task, read in order, once, packed."""
  folder = tmp_path / "data"
  data = double_win_data.write_study_data(str(folder), _CharVocab(), 3000, 1000)
  assert sorted(os.listdir(folder)) == ["train.jsonl", "validation.jsonl"]
  docs = {split: [json.loads(l) for l in open(folder / f"{split}.jsonl")]
          for split in ("train", "validation")}
  assert sum(len(d["text"]) for d in docs["train"]) == 3000
  assert sum(len(d["text"]) for d in docs["validation"]) == 1000
  assert not {d["id"] for d in docs["train"]} & {d["id"] for d in docs["validation"]}
  assert data == double_win_data.StudyData(
      str(folder / "train.jsonl"), str(folder / "validation.jsonl"),
      len(docs["train"]), len(docs["validation"]))
  again = double_win_data.write_study_data(str(tmp_path / "again"), _CharVocab(),
                                           3000, 1000, seed=0)
  assert (tmp_path / "again" / "train.jsonl").read_text() == (
      folder / "train.jsonl").read_text()
  assert again.train_documents == data.train_documents
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin"], double_win_data.gin_bindings(data),
                      finalize=False)
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == double_win_data.TASK
  first = double_win_data.one_pass("train", 1024, 1)
  second = double_win_data.one_pass("train", 1024, 1)
  for a, b in zip(first, second, strict=True):  # the same order, and it ends
    np.testing.assert_array_equal(a["decoder_target_tokens"], b["decoder_target_tokens"])
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  vocab = pipeline.vocabulary_for(double_win_data.TASK)
  first_document = list(vocab.encode(docs["train"][0]["text"]))[:16]
  assert first[0]["decoder_target_tokens"][0, :16].tolist() == first_document  # in order
  assert max(len(np.unique(s[s > 0])) for batch in first
             for s in batch["decoder_segment_ids"]) > 1  # packed
  gin.clear_config()


def test_the_study_report_from_hand_made_results(tmp_path):
  """report.md's settings lines, table and routing lines, and double_win.json's
  summary, from results made by hand (the slow end-to-end test checks a real run)."""
  results = _results(ar_dense=[5.0, 4.6], dlm_dense=[5.6, 4.5],
                     ar_moe=[4.9, 4.5], dlm_moe=[5.4, 4.1], se=0.125)
  results["parameters"] = {"dense": {"activated": 1000, "router": 0, "total": 1000},
                           "moe": {"activated": 1200, "router": 200, "total": 4200}}
  results["data"] = {"train_tokens": 3000, "train_documents": 5,
                     "validation_tokens": 1024, "validation_documents": 2}
  results["settings"] = {"seed": 0, "batch_size": 8, "sequence_length": 64,
                         "steps": 20, "dense_gin": "d.gin", "moe_gin": "m.gin",
                         "run_gin": "r.gin", "bindings": []}
  results["backend"], results["seconds"] = "cpu", 150.0
  for i, arm in enumerate(results["arms"].values()):
    arm["seconds"] = 30.0 * (i + 1)  # 30 + 60 + 90 + 120 s = 5 min
  results["arms"]["dlm_dense"]["tokens_per_sec"] = None  # not measured
  results["arms"]["ar_moe"]["routing"] = {"steps": [10, 20], "mean_to_final": [0.5, 1.0],
                                          "report": "ar_moe/analysis/report.md"}
  paths = double_win_report.write_report(results, str(tmp_path))
  lines = (tmp_path / "report.md").read_text().split("\n")
  assert lines[2:6] == [
      "Four arms, same data, seed (0), batch (8 x 64) and steps (20).",
      "- Activated parameters per token: dense 1,000, MoE 1,200 (the difference is the "
      "MoE router's 200 weights); total: dense 1,000, MoE 4,200.",
      "- Data: 3,000 unique training tokens (5 documents), repeated; 1,024 held-out "
      "tokens from 2 documents that never enter training.",
      "- Models: d.gin and m.gin; run file r.gin; extra bindings: none; backend cpu; "
      "training 5.0 min summed over the arms (evaluation and routing analysis not "
      "included); this invocation 2.5 min."]
  table = lines[lines.index("```") + 1:]
  header = table[0]
  assert table[1] == "-" * len(header)
  assert table[2].split() == ["ar_dense", "1,000", "4.6000", "4.6000", "4.0", "4.0",
                              "100"]
  assert table[3].split() == ["dlm_dense", "1,000", "4.5000", "±", "0.125", "4.5000",
                              "±", "0.125", "4.0", "4.0", "nan"]
  assert table[7].startswith("MoE gain (final): AR +0.1000, DLM +0.4000 ± 0.1768")
  assert lines[-2:] == ["- ar_moe: epoch 2.0: 0.500, epoch 4.0: 1.000 (full report: "
                        "ar_moe/analysis/report.md)", ""]
  saved = json.loads((tmp_path / "double_win.json").read_text())
  assert saved["summary"]["answers"] == double_win_report.answers(results)
  assert saved["summary"]["crossover"]["moe"]["epoch"] == 4.0
  with open(paths["plot"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
