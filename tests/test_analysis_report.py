"""The routing study's report and its records folder: report.md line by line from
results made by hand (analysis/report.py), and `analyze_records` / `load_records`
(analysis/study.py) on synthetic records whose answers are known."""
import json
import os

import numpy as np

from openmoe_jax.analysis import study
from openmoe_jax.analysis.report import write_report

from routing_records import E, SEQ, synthetic_record, tokens_positions

META = {"model_dir": "/runs/x", "step": 10, "tasks": ["code", "text"],
        "num_tokens": 4096, "num_batches": 2, "batch_size": 4, "sequence_length": 64,
        "pack": True, "rows_per_task": {"code": 3, "text": 4}, "capacity_factor": 1.25,
        "priority": None}
HEADER = [
    "# Routing analysis", "",
    "Model dir `/runs/x`, analysed checkpoint step 10, tasks code, text, 4096 tokens "
    "(up to 2 batches of 4 x 64 per task, packed=True; rows with real tokens per "
    "task: {'code': 3, 'text': 4}), training capacity factor 1.25, token-choice "
    "priority n/a.", ""]


def _results():
  tokens = [{"text": f"t{i}", "share": 0.5} for i in range(9)]
  return {
      "meta": META,
      "specialization": {
          "position_field": "position", "min_count": 5, "coverage": 0.875,
          "per_layer": [{"layer": 1,
                         "token": {"score": 0.5, "consistency": 0.75,
                                   "consistency_chance": 0.25},
                         "position": {"score": 0.07, "consistency": 0.3,
                                      "consistency_chance": 0.25}}],
          "token_score": 0.5, "position_score": float("nan"),
          "top_tokens_per_expert": [{"experts": [[], tokens]},  # earlier layers
                                    {"experts": [[], tokens]},
                                    {"experts": [tokens, []]}]},
      "drops": {
          "bucket_edges": [0, 32, 64], "position_field": "position",
          "by_task": {"code": [0.0, 0.25], "text": [None, 0.5]},
          "overall_by_task": {"code": 0.125, "text": 0.5},
          "first_quarter_by_task": {"code": 0.0},
          "last_quarter_by_task": {"code": 0.25, "text": 0.5},
          "by_layer": {"1": [0.1, 0.2]}, "by_choice_rank": {"2": [0.0, 0.4]}},
      "stability": {"num_tokens": 12, "min_count": 5, "chance": 0.125, "steps": [2, 10],
                    "mean_to_final": [0.5, 1.0], "mean_consecutive": [None, 0.5]},
      "domain_load": {"total_variation": {"code vs text": [0.25, 0.5]},
                      "layers": [1, 3]},
  }


def test_the_report_states_every_number_of_the_results(tmp_path):
  results = _results()
  paths = write_report(str(tmp_path), results)
  assert paths == {"markdown": str(tmp_path / "report.md"),
                   "json": str(tmp_path / "report.json")}
  shown = ", ".join(f"`'t{i}'` (50%)" for i in range(8))  # the first 8 of 9
  assert (tmp_path / "report.md").read_text().split("\n") == HEADER + [
      "## Token-ID specialization", "",
      "Share of top-1 routing entropy explained (chance-corrected; 1 = determined, 0 = "
      "independent) by token id vs by `position`, over tokens seen >= 5 times (87.5% "
      "of tokens).", "",
      "| MoE layer | token id score | position score | token consistency (chance) | "
      "position consistency (chance) |", "|---|---|---|---|---|",
      "| 1 | 0.500 | 0.070 | 0.750 (0.250) | 0.300 (0.250) |", "",
      "**Mean: token id 0.500, position n/a.**", "",
      "![specialization](specialization_scores.png)", "",
      "![token expert distribution](token_expert_distribution.png)", "",
      "Top tokens per expert (last MoE layer; tokens whose most common expert it is, "
      "most frequent first; share routed there):", "",
      f"- expert 0: {shown}", "- expert 1: (owns no frequent token)", "",
      "## Drop towards the end", "",
      "Dropped share of top-k choices by `position` bucket (the capacity is filled in "
      "sequence order within a group: all 1st choices before any 2nd choice with the "
      "choice_major priority, token by token with position_major).", "",
      "| | 0-31 | 32-63 | overall | first quarter | last quarter |",
      "|---|---|---|---|---|---|",
      "| code | 0.000 | 0.250 | 0.125 | 0.000 | 0.250 |",
      "| text | n/a | 0.500 | 0.500 | n/a | 0.500 |",
      "| layer 1 (all tasks) | 0.100 | 0.200 | | | |",
      "| choice 2 only (all tasks, layers) | 0.000 | 0.400 | | | |", "",
      "![drops](drop_by_position.png)", "",
      "## Early routing learning", "",
      "Share of the 12 frequent tokens (>= 5 occurrences) whose most common top-1 "
      "expert is the same as in the final / previous checkpoint (mean over MoE "
      "layers; chance 0.125).", "",
      "| step | vs final | vs previous |", "|---|---|---|",
      "| 2 | 0.500 | n/a |", "| 10 | 1.000 | 0.500 |", "",
      "![stability](routing_stability.png)", "",
      "## Domain specialization", "",
      "Expert load (share of top-k choices) per task; total variation distance between "
      "tasks per MoE layer (0 = same load, 1 = disjoint experts):", "",
      "- code vs text: layer 1: 0.250, layer 3: 0.500", "",
      "![domain load](domain_load.png)", ""]
  saved = json.loads((tmp_path / "report.json").read_text())
  assert saved["drops"] == results["drops"] and saved["meta"] == META
  assert np.isnan(saved["specialization"]["position_score"])


def test_a_report_holds_only_the_sections_it_has(tmp_path):
  meta = dict(META, priority="position_major")
  write_report(str(tmp_path), {"meta": meta,
                               "stability": _results()["stability"]})
  lines = (tmp_path / "report.md").read_text().split("\n")
  assert lines[2].endswith("token-choice priority position_major.")
  assert lines[4:] == ["## Early routing learning", "", lines[6], "",
                       "| step | vs final | vs previous |", "|---|---|---|",
                       "| 2 | 0.500 | n/a |", "| 10 | 1.000 | 0.500 |", "",
                       "![stability](routing_stability.png)", ""]


def _records_at(steps_and_shifts, n=4096):
  """Token-only routing (expert = (token + shift) mod E) over three tasks: "b" holds
  the last 16 rows and drops every choice from position 48 on; "c" holds the first
  and last 16 positions of the first 8 rows and drops nothing; "a" holds the rest
  (48 rows) and drops every choice before position 8. One record per (step, shift)."""
  token_n, position_n, _ = tokens_positions(n=n)
  row_n = np.arange(n) // SEQ
  task_n = np.where(row_n >= 48, 1, 0).astype(np.int16)
  task_n[(row_n < 8) & ((position_n < 16) | (position_n >= 48))] = 2
  kept_lnk = np.ones((2, n, 1), bool)
  kept_lnk[:, (task_n == 0) & (position_n < 8)] = False
  kept_lnk[:, (task_n == 1) & (position_n >= 48)] = False
  return [synthetic_record(token_n, position_n,
                           np.stack([(token_n + shift) % E] * 2), kept_lnk, task_n,
                           task_names=("a", "b", "c"), step=step)
          for step, shift in steps_and_shifts]


def test_records_load_in_step_order_with_or_without_their_meta(tmp_path):
  for record in _records_at([(10, 0), (2, 1)]):
    record.save(str(tmp_path / f"step_{record.step}.npz"))
  records, meta = study.load_records(str(tmp_path), model_dir="/runs/x")
  assert [r.step for r in records] == [2, 10]  # by number, not by name
  assert meta == {"model_dir": "/runs/x", "tasks": ["a", "b", "c"], "num_batches": None,
                  "batch_size": None, "sequence_length": SEQ, "pack": None,
                  "capacity_factor": None, "priority": None}
  (tmp_path / "meta.json").write_text(json.dumps(
      {"model_dir": "/elsewhere", "batch_size": 4, "capacity_factor": 1.25}))
  _, meta = study.load_records(str(tmp_path), model_dir="/runs/x")
  assert (meta["model_dir"], meta["batch_size"], meta["capacity_factor"],
          meta["sequence_length"]) == ("/elsewhere", 4, 1.25, SEQ)


def test_analyze_records_reports_the_final_record_and_the_learning_over_all(tmp_path):
  records = _records_at([(2, 2), (5, 0), (10, 0)])
  said = []
  meta = dict(META, tasks=["a", "b", "c"])  # its step, tokens and rows are replaced
  results = study.analyze_records(records, str(tmp_path), meta, num_buckets=4,
                                  say=said.append)
  assert results["meta"] == dict(meta, step=10, num_tokens=4096,
                                 checkpoints=[2, 5, 10],
                                 rows_per_task={"a": 48, "b": 16, "c": 8})
  assert results["drops"]["by_task"]["c"] == [0.0, None, None, 0.0]
  position_score = results["specialization"]["position_score"]
  assert abs(position_score) < 0.02  # chance-corrected: about 0
  assert said[:3] == [
      f"token-ID specialization: token id 1.000, position {position_score:.3f}",
      "drop rate, first -> last position bucket: a 0.500 -> 0.000; b 0.000 -> 1.000; "
      "c 0.000 -> 0.000",
      "top-expert overlap with the final checkpoint: step 2: 0.000, step 5: 1.000, "
      "step 10: 1.000"]
  assert said[3] == (f"wrote {tmp_path / 'report.md'} and {tmp_path / 'report.json'}")
  for png in ("specialization_scores", "token_expert_distribution", "drop_by_position",
              "routing_stability", "domain_load"):
    with open(tmp_path / f"{png}.png", "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
  assert sorted(os.listdir(tmp_path)) == sorted(
      ["report.md", "report.json", "specialization_scores.png",
       "token_expert_distribution.png", "drop_by_position.png", "routing_stability.png",
       "domain_load.png"])


def test_openmoe_analyze_reruns_the_analyses_from_records_alone(tmp_path, capsys):
  """--from_records without --model_dir: the report is written from the saved
  records, token ids decoded with the vocabulary of the records' first task, and
  the bucket and frequency flags reach the analyses. With no token frequent enough,
  the scores read n/a (the run used to stop on formatting None)."""
  from openmoe_jax.cli import analyze  # pylint: disable=g-import-not-at-top
  from openmoe_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  folder = tmp_path / "records"
  folder.mkdir()
  for record in _records_at([(2, 1), (10, 0)]):
    record.task_names = ["local_code", "local_text", "local_code_2"]
    record.save(str(folder / f"step_{record.step}.npz"))
  out = tmp_path / "out"
  assert analyze.main([f"--from_records={folder}", f"--output={out}",
                       "--num_buckets=4"]) == 0
  report = json.loads((out / "report.json").read_text())
  assert report["meta"]["checkpoints"] == [2, 10] and report["meta"]["model_dir"] is None
  assert report["drops"]["bucket_edges"] == [0, 16, 32, 48, 64]
  assert report["specialization"]["min_count"] == 5
  owned = [t for e in report["specialization"]["top_tokens_per_expert"][-1]["experts"]
           for t in e]
  vocab = pipeline.vocabulary_for("local_code")
  assert owned and all(t["text"] == vocab.decode([t["token_id"]]) for t in owned)
  assert f"wrote {out / 'report.md'}" in capsys.readouterr().out
  rare = tmp_path / "rare"
  assert analyze.main([f"--from_records={folder}", f"--output={rare}",
                       "--min_count=100000"]) == 0
  said = capsys.readouterr().out
  assert "token-ID specialization: token id n/a, position n/a" in said
  assert "top-expert overlap with the final checkpoint: step 2: n/a, step 10: n/a" in said
  report = json.loads((rare / "report.json").read_text())
  assert report["specialization"]["min_count"] == report["stability"]["min_count"] == 100000
  assert report["specialization"]["coverage"] == 0.0
  assert "**Mean: token id n/a, position n/a.**" in (rare / "report.md").read_text()


def test_openmoe_analyze_needs_a_run_or_records_and_reads_true_or_false(capsys):
  from openmoe_jax.cli import analyze  # pylint: disable=g-import-not-at-top
  assert analyze.main(["--output=x"]) == 2
  assert "give --model_dir (or --from_records)" in capsys.readouterr().err
  for text, value in (("true", True), ("YES", True), ("1", True), ("False", False),
                      ("no", False), ("0", False)):
    assert analyze.PROGRAM.parse(["--output=x", f"--pack={text}"])[0].pack is value
  assert analyze.main(["--output=x", "--model_dir=y", "--pack=maybe"]) == 2
  assert "expected true or false, got 'maybe'" in capsys.readouterr().err


def test_openmoe_analyze_defaults_and_the_smallest_values_it_takes(capsys):
  from openmoe_jax.cli import analyze  # pylint: disable=g-import-not-at-top
  args = analyze.PROGRAM.parse(["--output=x"])[0]
  assert (args.checkpoints, args.tasks, args.num_batches, args.batch_size,
          args.sequence_length, args.pack, args.split, args.num_buckets, args.min_count,
          args.from_records, args.priority) == (
              "all", "local_code,local_text", 16, None, None, True, "validation", 8, 5,
              None, None)
  ones = analyze.PROGRAM.parse(["--output=x", "--num_batches=1", "--batch_size=1",
                                "--sequence_length=1", "--num_buckets=1",
                                "--min_count=1"])[0]
  assert (ones.num_batches, ones.batch_size, ones.sequence_length, ones.num_buckets,
          ones.min_count) == (1, 1, 1, 1, 1)
  assert analyze.main(["--model_dir=y"]) == 2
  assert "the following arguments are required: --output" in capsys.readouterr().err
