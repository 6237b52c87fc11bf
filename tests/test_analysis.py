"""Routing analysis: analyses on synthetic records with known answers, the recorder
against the model's own routing statistics, and `openmoe-analyze` end to end."""
import dataclasses
import json
import os

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.analysis import analyses, study
from openmoe_jax.analysis.record import (RoutingRecord, _check_token_choice,
                                         make_routing_fn, record_routing)
from openmoe_jax.cli import analyze as cli
from openmoe_jax.cli import flags
from openmoe_jax.config import ModelConfig, MoeConfig
from openmoe_jax.model import Decoder
from openmoe_jax.moe.layer import router_of
from openmoe_jax.moe.routers_expert_choice import ExpertChoiceRouter
from openmoe_jax.trainer import train

from routing_records import E, SEQ, synthetic_record, tokens_positions

def test_token_id_only_routing_scores_one_and_position_at_chance():
  token_n, position_n, _ = tokens_positions()
  expert_lnk = np.stack([token_n % E, (3 * token_n + 1) % E])
  result = analyses.token_specialization(synthetic_record(token_n, position_n, expert_lnk),
                                         decode=lambda i: f"<{i}>")
  assert result["token_score"] == pytest.approx(1.0, abs=1e-9)
  assert abs(result["position_score"]) < 0.02
  for layer in result["per_layer"]:
    assert layer["token"]["consistency"] == pytest.approx(1.0)
    assert layer["position"]["consistency"] == pytest.approx(
        layer["position"]["consistency_chance"], abs=0.02)
  # Every token id goes to one expert, and the owner lists say so.
  dist = np.array(result["token_expert_distribution"][0]["distribution"])
  assert np.allclose(dist.max(-1), 1.0)
  owners = result["top_tokens_per_expert"][0]["experts"]
  for e, tokens in enumerate(owners):
    assert tokens and all(t["token_id"] % E == e and t["share"] == 1.0 for t in tokens)
    assert tokens[0]["text"] == f"<{tokens[0]['token_id']}>"


def test_explained_routing_entropy_and_information_by_hand():
  """H(expert), I(expert; label) and consistency on 8 choices worked out by hand."""
  labels_n = np.array([0, 0, 0, 0, 1, 1, 1, 1])
  expert_n = np.array([0, 0, 0, 1, 1, 1, 2, 2])
  # Experts 3, 3, 2 of 8: H(E) = 2 * (3/8) log2(8/3) + (2/8) log2(4).
  h = 0.75 * np.log2(8 / 3) + 0.5
  # Label 0: experts (3, 1) -> 0.75 log2(4/3) + 0.25 log2(4); label 1: (2, 2) -> 1.
  h_cond = 0.5 * (0.75 * np.log2(4 / 3) + 0.5) + 0.5 * 1.0
  got = analyses.explained_routing(labels_n, expert_n, 4, np.random.default_rng(0))
  assert got["entropy_bits"] == pytest.approx(h, abs=1e-12)
  assert got["mutual_information_bits"] == pytest.approx(h - h_cond, abs=1e-12)
  assert got["consistency"] == pytest.approx((3 + 2) / 8)


def test_position_only_routing_scores_the_other_way_round():
  token_n, position_n, _ = tokens_positions()
  result = analyses.token_specialization(synthetic_record(token_n, position_n, position_n[None] % E))
  assert result["position_score"] == pytest.approx(1.0, abs=1e-9)
  assert abs(result["token_score"]) < 0.02


def test_random_routing_scores_near_zero_despite_rare_token_ids():
  # Many ids with few occurrences each: a plug-in estimate alone would say ~0.3.
  token_n, position_n, rng = tokens_positions(n=8000, vocab=1500)
  expert_lnk = rng.integers(0, E, (1, token_n.size))
  result = analyses.token_specialization(synthetic_record(token_n, position_n, expert_lnk),
                                         min_count=2)
  assert abs(result["token_score"]) < 0.03 and abs(result["position_score"]) < 0.03


def test_drop_rates_by_position_match_a_direct_count():
  token_n, position_n, rng = tokens_positions(n=4096)
  task_n = rng.integers(0, 2, token_n.size)
  expert_lnk = rng.integers(0, E, (2, token_n.size, 2))
  # Drops grow towards the end of the sequence, faster for task 1.
  p_drop_n = position_n / SEQ * (0.5 + 0.4 * task_n)
  kept_lnk = rng.random(expert_lnk.shape) >= p_drop_n[None, :, None]
  rec = synthetic_record(token_n, position_n, expert_lnk, kept_lnk, task_n, ("code", "text"))
  result = analyses.drop_by_position(rec, num_buckets=4)
  assert result["bucket_edges"] == [0, 16, 32, 48, 64]
  for t, task in enumerate(("code", "text")):
    for b in range(4):
      sel = (task_n == t) & (position_n >= 16 * b) & (position_n < 16 * (b + 1))
      direct = 1 - kept_lnk[:, sel].sum() / kept_lnk[:, sel].size
      assert result["by_task"][task][b] == pytest.approx(direct)
    late = (task_n == t) & (position_n >= 48)
    assert result["last_quarter_by_task"][task] == pytest.approx(
        1 - kept_lnk[:, late].mean())
    early = (task_n == t) & (position_n < 16)
    assert result["first_quarter_by_task"][task] == pytest.approx(
        1 - kept_lnk[:, early].mean())
    assert result["by_task"][task][0] < result["by_task"][task][-1]
  for l, name in enumerate(("1", "3")):
    sel = position_n < 16
    assert result["by_layer"][name][0] == pytest.approx(1 - kept_lnk[l, sel].mean())
    assert result["by_choice_rank"][str(l + 1)][0] == pytest.approx(
        1 - kept_lnk[:, sel, l].mean())
    assert result["by_task_layer"]["code"][name][3] == pytest.approx(
        1 - kept_lnk[l, (task_n == 0) & (position_n >= 48)].mean())


def test_routing_stability_identical_is_one_and_independent_is_one_over_e():
  token_n, position_n, rng = tokens_positions(n=24000, vocab=400)
  fixed = synthetic_record(token_n, position_n, np.stack([token_n % E, token_n // 3 % E]), step=10)
  same = analyses.routing_stability([fixed, dataclasses.replace(fixed, step=20)])
  assert same["steps"] == [10, 20] and same["num_tokens"] == 400
  assert same["mean_to_final"] == [1.0, 1.0] and same["mean_consecutive"] == [None, 1.0]
  # Independent random top experts per token id at each checkpoint.
  records = []
  for step in (1, 2, 3):
    table_lv = rng.integers(0, E, (2, 400))
    records.append(synthetic_record(token_n, position_n, table_lv[:, token_n], step=step))
  result = analyses.routing_stability(records)
  assert result["chance"] == 1 / E and result["mean_to_final"][-1] == 1.0
  for value in result["mean_to_final"][:-1] + result["mean_consecutive"][1:]:
    assert value == pytest.approx(1 / E, abs=0.05)
  with pytest.raises(ValueError, match="routing_stability needs at least one record"):
    analyses.routing_stability([])


def test_a_task_without_tokens_has_no_drop_rates():
  token_n, position_n, _ = tokens_positions(n=256)
  kept_lnk = (position_n < 32)[None, :, None]
  rec = synthetic_record(token_n, position_n, np.zeros((1, 256)), kept_lnk,
                np.zeros(256), ("code", "empty"))
  result = analyses.drop_by_position(rec, num_buckets=2)
  assert result["overall_by_task"] == {"code": 0.5, "empty": None}
  assert result["by_task"] == {"code": [0.0, 1.0], "empty": [None, None]}
  assert result["last_quarter_by_task"] == {"code": 1.0, "empty": None}


def test_routing_stability_counts_ids_frequent_in_every_record_and_compares_neighbours():
  """Ids seen at least min_count times in every record (7: 5 and 5 times; not 9: 5
  and 4; not 11: 3 and 6); the consecutive overlap compares each step with the one
  before it: steps 2 and 3 route alike, step 1 elsewhere."""
  def record(counts, expert_of, step):
    token_n = np.concatenate([np.full(n, t) for t, n in counts.items()])
    expert_n = np.array([expert_of[t] for t in token_n])
    return synthetic_record(token_n, np.arange(token_n.size) % SEQ, expert_n[None], step=step)
  first = {7: 5, 9: 5, 11: 3}
  later = {7: 5, 9: 4, 11: 6}
  records = [record(first, {7: 1, 9: 1, 11: 1}, 1), record(later, {7: 3, 9: 3, 11: 3}, 2),
             record(later, {7: 3, 9: 2, 11: 2}, 3)]
  result = analyses.routing_stability(records)
  assert result["num_tokens"] == 1
  assert result["mean_to_final"] == [0.0, 1.0, 1.0]
  assert result["mean_consecutive"] == [None, 0.0, 1.0]


def test_domain_load_heatmap_numbers():
  token_n, position_n, rng = tokens_positions(n=1000)
  task_n = (np.arange(1000) >= 500).astype(int)
  expert_lnk = np.where(task_n == 0, 0, rng.integers(0, 2, 1000) + 1)[None]
  result = analyses.domain_load(synthetic_record(token_n, position_n, expert_lnk, task_n=task_n,
                                        task_names=("code", "text")))
  load = np.array(result["load"])
  assert load.shape == (2, 1, E) and np.allclose(load.sum(-1), 1)
  assert load[0, 0, 0] == 1.0 and load[1, 0, 1] == pytest.approx(0.5, abs=0.06)
  assert result["total_variation"]["code vs text"] == [1.0]


def test_total_variation_between_every_pair_of_tasks():
  """Task a on expert 0, task b half on 0 and half on 1, task c on 1."""
  token_n, position_n, _ = tokens_positions(n=300)
  task_n = np.arange(300) // 100
  expert_n = np.where(task_n == 0, 0, np.where(task_n == 2, 1, np.arange(300) % 2))
  result = analyses.domain_load(synthetic_record(token_n, position_n, expert_n[None],
                                        task_n=task_n, task_names=("a", "b", "c")))
  assert result["total_variation"] == {"a vs b": [0.5], "a vs c": [1.0], "b vs c": [0.5]}


def test_record_roundtrip(tmp_path):
  token_n, position_n, rng = tokens_positions(n=300)
  rec = synthetic_record(token_n, position_n, rng.integers(0, E, (2, 300, 2)), step=7,
                kept_lnk=rng.random((2, 300, 2)) > 0.3)
  back = RoutingRecord.load(rec.save(str(tmp_path / "r.npz")))
  for field in ("token", "position", "task", "expert", "gate", "kept"):
    np.testing.assert_array_equal(getattr(back, field), getattr(rec, field))
  assert (back.step, back.moe_layers, back.task_names) == (7, [1, 3], ["a"])


@pytest.mark.parametrize("scan_layers", [True, False])
def test_recorder_agrees_with_the_model_routing_statistics(scan_layers):
  # Segments: a dense unit, then (dense, MoE) x 2: layer order must survive both.
  cfg = ModelConfig(vocab_size=128, d_model=32, num_heads=2, head_dim=16, d_ff=48,
                    num_layers=6, sparse_interval=2, num_dense_first=2,
                    scan_layers=scan_layers,
                    moe=MoeConfig(num_experts=4, group_size=32, min_capacity=1,
                                  capacity_factor_train=0.75))
  assert cfg.moe_layer_numbers() == [3, 5]
  b, t = 4, 32
  tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t), 1, 128)
  # Jitted: op by op, the unscanned init alone took about a minute on a slow CPU.
  params = nn.unbox(jax.jit(Decoder(cfg).init)(jax.random.PRNGKey(0), tokens))["params"]
  batch = {"decoder_input_tokens": np.asarray(tokens, np.int32),
           "decoder_positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
           "decoder_segment_ids": np.ones((b, t), np.int32)}
  routing_fn = make_routing_fn(cfg)
  routing, aux = jax.device_get(routing_fn(params, batch))
  assert routing["expert_index"].shape == (2, b, t, 2)
  drop_l = 1 - routing["kept"].mean(axis=(1, 2, 3))
  np.testing.assert_allclose(drop_l, aux["drop_fraction"], atol=1e-6)
  assert drop_l.min() > 0  # capacity binds, so the drops say something
  load_le = np.stack([np.bincount(routing["expert_index"][l].ravel(), minlength=4)
                      for l in range(2)]) / (b * t * 2)
  np.testing.assert_allclose(load_le, aux["expert_load"], atol=1e-6)
  assert not np.allclose(load_le[0], load_le[1])  # layers are told apart
  rec = record_routing(cfg, params, {"x": [batch]}, batch_size=b, step=0,
                       routing_fn=routing_fn)
  np.testing.assert_allclose(1 - rec.kept.mean(axis=(1, 2)), aux["drop_fraction"],
                             atol=1e-6)
  assert rec.token.shape == (b * t,) and rec.moe_layers == [3, 5]
  # Training's capacity (factor 0.75) by default, not evaluation's (2.0).
  eval_routing, _ = jax.device_get(make_routing_fn(cfg, train=False)(params, batch))
  assert np.all(drop_l > 1 - eval_routing["kept"].mean(axis=(1, 2, 3)))
  default = record_routing(cfg, params, {"x": [batch]}, batch_size=b, step=0)
  np.testing.assert_array_equal(default.kept, rec.kept)


def test_analyze_priority_flag_reroutes_token_choice_only():
  cfg = ModelConfig(moe=MoeConfig(num_experts=4))
  assert study.with_priority(cfg, None) is cfg
  rerouted = study.with_priority(cfg, "position_major")
  assert rerouted.moe.router.priority == "position_major"
  assert (rerouted.moe.router.capacity_per_choice
          == router_of(cfg.moe).capacity_per_choice)
  assert cli.PROGRAM.parse(["--model_dir=x", "--output=y", "--priority=position_major"]
                          )[0].priority == "position_major"
  with pytest.raises(flags.UsageError, match="priority"):
    cli.PROGRAM.parse(["--model_dir=x", "--output=y", "--priority=random"])
  with pytest.raises(ValueError, match="token-choice"):
    study.with_priority(cfg.replace(moe=cfg.moe.replace(router=ExpertChoiceRouter())),
                      "position_major")


def test_recorder_refuses_expert_choice_routing():
  expert_lbtk = np.broadcast_to(np.arange(4), (2, 3, 5, 4))
  with pytest.raises(ValueError, match="expert choice"):
    _check_token_choice(expert_lbtk, 4)
  _check_token_choice(expert_lbtk[..., ::-1], 4)  # ranked choices pass


TINY_BINDINGS = [
    "ModelConfig.d_model = 32", "ModelConfig.num_heads = 2", "ModelConfig.head_dim = 16",
    "ModelConfig.d_ff = 64", "ModelConfig.num_layers = 2", "MoeConfig.num_experts = 4",
    "MoeConfig.group_size = 64", "SEQUENCE_LENGTH = 64", "BATCH_SIZE = 8",
    "train.eval_batches = 1", "train.log_every_steps = 2", "train.eval_every_steps = 100",
    "train.checkpoint_every_steps = 2", "adamw_warmup_cosine.warmup_steps = 1",
]


@pytest.mark.slow
def test_openmoe_analyze_end_to_end(tmp_path, capsys):
  model_dir, out = tmp_path / "run", tmp_path / "analysis"
  gin_utils.import_configurables()
  gin_utils.parse_gin(["runs/quickstart.gin"], TINY_BINDINGS + [
      f"MODEL_DIR = '{model_dir}'", "TRAIN_STEPS = 4"])
  train(print_fn=lambda *_: None)
  gin.clear_config()
  assert cli.main([f"--model_dir={model_dir}", f"--output={out}", "--num_batches=2",
                   "--tasks=local_code,local_text"]) == 0
  console = capsys.readouterr().out
  assert "recorded step 2" in console and "token-ID specialization" in console
  report = json.loads((out / "report.json").read_text())
  assert report["meta"]["checkpoints"] == [2, 4] and report["meta"]["step"] == 4
  assert set(report["drops"]["by_task"]) == {"local_code", "local_text"}
  assert report["stability"]["mean_to_final"][-1] == 1.0
  assert -1.0 <= report["specialization"]["token_score"] <= 1.0 + 1e-9
  markdown = (out / "report.md").read_text()
  for png in ("specialization_scores", "token_expert_distribution", "drop_by_position",
              "routing_stability", "domain_load"):
    assert (out / f"{png}.png").stat().st_size > 5000
    assert f"({png}.png)" in markdown
  assert sorted(os.listdir(out / "records")) == ["meta.json", "step_2.npz", "step_4.npz"]
  # The records alone are enough to rerun the analyses.
  again = tmp_path / "again"
  assert cli.main([f"--from_records={out / 'records'}", f"--output={again}",
                   f"--model_dir={model_dir}"]) == 0
  assert json.loads((again / "report.json").read_text())["drops"] == report["drops"]


def test_domain_load_counts_every_choice_not_only_the_first():
  """Two choices per token, the 1st always expert 0, the 2nd always expert 1: each
  of the two experts holds half of all top-k choices."""
  token_n, position_n, _ = tokens_positions(n=128)
  expert_lnk = np.stack([np.zeros(128), np.ones(128)], axis=-1)[None]
  load = np.array(analyses.domain_load(synthetic_record(token_n, position_n, expert_lnk))["load"])
  np.testing.assert_allclose(load[0, 0], [0.5, 0.5] + [0.0] * (E - 2))


def test_token_specialization_counts_ids_seen_exactly_min_count_times():
  """min_count is inclusive: an id seen 5 times counts at min_count=5, one seen 4
  times does not (coverage = 5 / 9 of the tokens)."""
  token_n = np.array([7] * 5 + [9] * 4)
  position_n = np.arange(9)
  result = analyses.token_specialization(
      synthetic_record(token_n, position_n, np.zeros((1, 9))), min_count=5)
  assert result["coverage"] == pytest.approx(5 / 9)
  assert result["token_expert_distribution"][0]["token_ids"] == [7]


def test_entropy_of_rows_with_empty_and_single_counts():
  """A row with one choice, or all choices on one expert, has no entropy; an empty
  row none either (not NaN); two equally loaded experts, one bit."""
  got = analyses._entropy_bits(np.array([[0, 1, 0], [0, 0, 0], [0, 5, 0], [2, 0, 2]]))  # pylint: disable=protected-access
  np.testing.assert_array_equal(got, [0.0, 0.0, 0.0, 1.0])


def test_routing_with_no_entropy_explains_nothing():
  """Every token on expert 2: nothing to explain, score 0 (not 0 / 0)."""
  labels_n = np.arange(40) % 5
  got = analyses.explained_routing(labels_n, np.full(40, 2), E, np.random.default_rng(0))
  assert (got["entropy_bits"], got["score"], got["consistency"]) == (0.0, 0.0, 1.0)


def test_the_token_lists_put_the_most_frequent_ids_first():
  """The distribution's top ids and each expert's owned ids, by count; shares at 4
  decimals. Ids 4 and 12 both go to expert 4 (6 and 8 times); id 9 goes 4 times of
  6 to expert 1 and twice to expert 2."""
  token_n = np.array([4] * 6 + [8] * 9 + [5] * 7 + [3] * 5 + [12] * 8 + [9] * 6)
  expert_n = token_n % E
  expert_n[token_n == 9] = [1, 1, 2, 1, 2, 1]
  result = analyses.token_specialization(
      synthetic_record(token_n, np.arange(token_n.size) % SEQ, expert_n[None]), top_tokens=2)
  layer = result["token_expert_distribution"][0]
  assert (layer["token_ids"], layer["counts"]) == ([8, 12], [9, 8])
  experts = result["top_tokens_per_expert"][0]["experts"]
  assert [(t["token_id"], t["count"]) for t in experts[4]] == [(12, 8), (4, 6)]
  assert experts[1] == [{"token_id": 9, "text": "9", "count": 4, "share": 0.6667}]
  everything = analyses.token_specialization(
      synthetic_record(token_n, np.arange(token_n.size) % SEQ, expert_n[None]), top_tokens=6)
  row_9 = everything["token_expert_distribution"][0]["token_ids"].index(9)
  assert everything["token_expert_distribution"][0]["distribution"][row_9][1:3] == [
      0.6667, 0.3333]


_ROW_CFG = ModelConfig(vocab_size=16, d_model=8, num_heads=1, head_dim=8, d_ff=8,
                       num_layers=2, sparse_interval=2, moe=MoeConfig(num_experts=E))


def _to_expert_0(params, batch):
  """A routing_fn stand-in: one MoE layer sending every token to expert 0."""
  del params
  shape = (1,) + batch["decoder_input_tokens"].shape + (1,)
  return {"expert_index": np.zeros(shape, np.int32),
          "gates": np.ones(shape, np.float32), "kept": np.ones(shape, bool)}, {}


def _rows_of(token, b, t=4):
  return {"decoder_input_tokens": np.full((b, t), token, np.int32),
          "decoder_positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
          "decoder_segment_ids": np.ones((b, t), np.int32)}


def test_record_numbers_rows_across_batches_and_tasks():
  """Row ids count on over every batch of every task (batch 2 of 2-row batches holds
  rows 2 and 3), so tokens of different rows are never merged."""
  rec = record_routing(_ROW_CFG, {}, {"x": [_rows_of(1, 2), _rows_of(1, 2)],
                                      "y": [_rows_of(1, 2)]},
                       batch_size=2, routing_fn=_to_expert_0)
  np.testing.assert_array_equal(rec.row, np.repeat(np.arange(6), 4))
  np.testing.assert_array_equal(rec.task, [0] * 16 + [1] * 8)


def test_a_short_last_batch_is_padded_and_a_task_without_batches_refused():
  """A last batch of 1 row runs padded to the batch size of 2 (one compiled shape);
  only its real row is recorded."""
  seen_rows = []

  def routing_fn(params, batch):
    seen_rows.append(batch["decoder_input_tokens"].shape[0])
    return _to_expert_0(params, batch)

  rec = record_routing(_ROW_CFG, {}, {"x": [_rows_of(1, 2), _rows_of(7, 1)]},
                       batch_size=2, routing_fn=routing_fn)
  assert seen_rows == [2, 2]
  np.testing.assert_array_equal(rec.token, [1] * 8 + [7] * 4)
  with pytest.raises(ValueError, match="task 'y' gave no batches: is its split empty?"):
    record_routing(_ROW_CFG, {}, {"x": [_rows_of(1, 2)], "y": []}, batch_size=2,
                   routing_fn=_to_expert_0)


def test_checkpoint_selection_all_latest_or_listed_steps():
  available = [2, 4, 6]
  assert cli._select_steps(available, "all") == available  # pylint: disable=protected-access
  assert cli._select_steps(available, "latest") == [6]  # pylint: disable=protected-access
  assert cli._select_steps(available, "6, 2,6") == [2, 6]  # pylint: disable=protected-access
  for spec, message in (("x", "give 'all', 'latest' or comma-separated steps from "
                         r"\[2, 4, 6\]"), (",", "give 'all'"),
                        ("2,5", r"no checkpoint at step\(s\) \[5\]; available")):
    with pytest.raises(flags.UsageError, match=message):
      cli._select_steps(available, spec)  # pylint: disable=protected-access
