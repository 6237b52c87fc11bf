"""Tests for real-data sources (text, TFRecord, ArrayRecord, TFDS) and OpenMoE's mixtures."""

import json
import os

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

import openmoe_jax
from openmoe_jax import _source_tasks
from openmoe_jax import tasks as tasks_lib
from openmoe_jax.data import pipeline
from openmoe_jax.data import sources
from openmoe_jax.data import vocabulary as vocab_lib
from openmoe_jax.tasks import openmoe

# Relative weights of OpenMoE's data versions I-III as its t5x gin files give them
# (github.com/XueFuzhao/t5x; Xue et al. 2024, arXiv:2402.01739), written out here
# independently of tasks/openmoe.py.
WEIGHTS = {
    "v1": {"c4": 15, "wikipedia": 4.5, "stackexchange": 2, "arxiv": 2.5, "book": 4.5,
           "github": 4.5, "common_crawl": 67, "the_stack": 100},
    "v2": {"c4": 15, "rp_wiki": 6.5, "wiki": 6.5, "stackexchange": 2.5, "arxiv": 4.5,
           "book": 6.5, "github": 5, "common_crawl": 43.5, "the_stack": 10},
    "v3": {"c4": 15, "rp_wiki": 4.5, "wiki": 2.5, "stackexchange": 1, "arxiv": 4.5,
           "book": 4.5, "github": 5, "common_crawl": 33, "the_stack": 30},
}
OUR_NAME = {"c4": "rp_c4", "rp_wiki": "rp_wikipedia", "wiki": "wikipedia",
            "stackexchange": "rp_stackexchange", "arxiv": "rp_arxiv",
            "book": "rp_book", "github": "rp_github",
            "common_crawl": "rp_common_crawl", "the_stack": "the_stack_dedup"}


def _expected(version):
  weights = WEIGHTS[version]
  total = sum(weights.values())
  ours = {OUR_NAME.get(k, "rp_wikipedia" if version == "v1" else k): w / total
          for k, w in weights.items()}
  assert len(ours) == len(weights)
  return ours


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_mixture_rates_are_openmoes_normalised(version):
  pipeline.tasks.register_tasks()
  lm = seqio.get_mixture_or_task(f"openmoe_{version}")
  got = {t.name[len("openmoe_"):]: lm.get_rate(t) / lm.total_rate for t in lm.tasks}
  assert got == pytest.approx(_expected(version), abs=1e-12)
  assert openmoe.mixture_rates(version) == pytest.approx(_expected(version))
  ul2 = seqio.get_mixture_or_task(f"openmoe_{version}_ul2")
  per_source = {}
  for t in ul2.tasks:  # six denoiser tasks per source
    source = t.name[len("openmoe_"):t.name.index("_ul2")]
    per_source[source] = per_source.get(source, 0) + ul2.get_rate(t) / ul2.total_rate
  assert per_source == pytest.approx(_expected(version), abs=1e-12)
  if version == "v1":  # about half code
    assert got["the_stack_dedup"] == pytest.approx(0.5)


def test_registration_reads_nothing():
  gin.parse_config("""
      openmoe_sources.sources = {"rp_arxiv": @arxiv/text_files()}
      arxiv/text_files.split_to_filepattern = {"train": "gs://no-such-bucket-x/a/*.jsonl"}
      openmoe_sources.tfds_data_dir = "gs://no-such-bucket-x/tfds"
  """)
  names = pipeline.tasks.register_tasks()
  assert {"openmoe_v1", "openmoe_v2_ul2", "openmoe_rp_arxiv"} <= set(names)
  stack = seqio.get_mixture_or_task("openmoe_the_stack_dedup").source
  assert isinstance(stack, seqio.TfdsDataSource)
  assert stack.tfds_dataset.name == "the_stack_dedup:1.0.0"
  assert set(stack.splits) == {"train", "validation"}  # no TFDS metadata read
  arxiv = seqio.get_mixture_or_task("openmoe_rp_arxiv").source
  assert isinstance(arxiv, seqio.TextLineDataSource)
  with pytest.raises(ValueError):
    openmoe.openmoe_sources(sources={"nope": arxiv})


def _write_sources(tmp_path):
  """Writes one small file per OpenMoE source in a mix of formats; returns gin."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  lines, refs = [], {}
  for i, name in enumerate(openmoe.DEFAULT_TFDS):
    docs = [f"{name} {j}\n" for j in range(40)]  # one example each
    path = tmp_path / name
    kind = ("jsonl", "text", "tfrecord", "array_record")[i % 4]
    if kind == "jsonl":
      path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
      lines.append(f'{name}/text_files.split_to_filepattern = {{"train": "{path}"}}')
      ref = f"@{name}/text_files()"
    elif kind == "text":
      path.write_text("".join(d.replace("\n", " ") + "\n" for d in docs))
      lines.append(f'{name}/text_files.split_to_filepattern = {{"train": "{path}"}}')
      lines.append(f'{name}/text_files.file_format = "text"')
      ref = f"@{name}/text_files()"
    else:
      records = [tf.train.Example(features=tf.train.Features(feature={
          "content": tf.train.Feature(bytes_list=tf.train.BytesList(
              value=[d.encode()]))})).SerializeToString() for d in docs]
      if kind == "tfrecord":
        with tf.io.TFRecordWriter(str(path)) as w:
          for r in records:
            w.write(r)
        fn = "tfrecord_files"
      else:
        w = ArrayRecordWriter(str(path), "group_size:1")
        for r in records:
          w.write(r)
        w.close()
        fn = "array_record_files"
      lines.append(f'{name}/{fn}.split_to_filepattern = {{"train": "{path}"}}')
      lines.append(f'{name}/{fn}.text_feature = "content"')
      ref = f"@{name}/{fn}()"
    refs[name] = ref
  mapping = ", ".join(f'"{n}": {ref}' for n, ref in refs.items())
  lines.append(f"openmoe_sources.sources = {{{mapping}}}")
  return "\n".join(lines)


def _source_of(text):
  for name in sorted(openmoe.DEFAULT_TFDS, key=len, reverse=True):
    if text.startswith(name + " "):
      return name
  return None


def test_mixtures_over_local_files_yield_batches(tmp_path):
  gin.parse_config(_write_sources(tmp_path))
  vocab = vocab_lib.get_vocabulary()
  counts = {}
  for batch in pipeline.get_dataset("openmoe_v1", 32, 64, pack=False,
                                    num_batches=8, seed=3):
    assert set(batch) == set(pipeline.BATCH_KEYS)
    for row in batch["decoder_target_tokens"]:
      ids = [int(t) for t in row if t not in (0, vocab.eos_id)]
      name = _source_of(vocab.decode(ids))
      counts[name] = counts.get(name, 0) + 1
  total = sum(counts.values())
  assert total == 8 * 64 and None not in counts
  assert "wikipedia" not in counts  # v1 has no separate wiki
  shares = {k: v / total for k, v in counts.items()}
  print("openmoe_v1 realised shares:", {k: round(v, 3) for k, v in shares.items()})
  for name, rate in openmoe.mixture_rates("v1").items():
    assert abs(shares.get(name, 0.0) - rate) < 0.06, (name, shares)

  # UL2 over one source (ArrayRecord here); the v3 UL2 mixture has 54 tasks.
  batch = next(pipeline.get_dataset("openmoe_rp_arxiv_ul2", 64, 4, seed=1))
  weights, prefix = batch["decoder_loss_weights"], batch[pipeline.PREFIX_KEY]
  segments = sum(len(np.unique(s[s > 0])) for s in batch["decoder_segment_ids"])
  assert weights.sum() > segments
  assert (weights * prefix).sum() == segments  # seqio's one shared position


def test_array_record_text_records(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  path = tmp_path / "plain.array_record"
  w = ArrayRecordWriter(str(path), "group_size:1")
  for i in range(5):
    w.write(f"line {i}".encode())
  w.close()
  src = sources.array_record_files({"train": str(path)}, record_format="text")
  ds = src.source.get_dataset("train", shuffle=False)
  for p in src.preprocessors:
    ds = p(ds)
  assert [ex["targets"].decode() for ex in ds.as_numpy_iterator()] == [
      f"line {i}" for i in range(5)]


def test_source_task_from_gin_tfrecord_ul2(tmp_path):
  path = tmp_path / "code.tfrecord"
  with tf.io.TFRecordWriter(str(path)) as w:
    for i in range(30):
      w.write(tf.train.Example(features=tf.train.Features(feature={
          "content": tf.train.Feature(bytes_list=tf.train.BytesList(
              value=[f"def f{i}(x):\n    return x + {i}\n".encode()]))}))
              .SerializeToString())
  gin.parse_config(f"""
      register_tasks.file_tasks = [@code/source_task]
      code/source_task.name = "code_ul2"
      code/source_task.objective = "ul2"
      code/source_task.source = @code/tfrecord_files()
      code/tfrecord_files.split_to_filepattern = {{"train": "{path}"}}
      code/tfrecord_files.text_feature = "content"
  """)
  batch = next(pipeline.get_dataset("code_ul2", 64, 2, seed=0))
  assert pipeline.PREFIX_KEY in batch and batch["decoder_loss_weights"].sum() > 0
  assert len(seqio.get_mixture_or_task("code_ul2").tasks) == 6


def test_tasks_come_from_the_same_tree_as_the_package():
  package = os.path.dirname(os.path.abspath(openmoe_jax.__file__))
  checkout = os.path.dirname(package)
  if os.path.isfile(os.path.join(checkout, "setup.py")):  # a source checkout
    expected = os.path.join(checkout, "tasks", "__init__.py")
  else:  # installed: setup.py's package_dir put tasks/ inside the package
    expected = os.path.join(package, "tasks", "__init__.py")
  assert os.path.abspath(tasks_lib.__file__) == expected
  assert openmoe.__name__ == "openmoe_jax.tasks.openmoe"
  assert _source_tasks.SourceTasksFinder.find_spec("openmoe_jax.other") is None


def test_local_mix_rates_follow_code_rate_for_lm_and_ul2():
  """Both local mixtures (causal LM and UL2) take code_rate and 1 - code_rate, at a
  code_rate other than the default 0.5 (where swapped or copied rates look right)."""
  gin.bind_parameter("local_mix_rates.code_rate", 0.15)
  pipeline.tasks.register_tasks()
  expected = {"code": 0.15, "text": 0.85}
  try:
    for name in ("local_mix", "local_mix_ul2"):
      mix = seqio.get_mixture_or_task(name)
      per_source = {}
      for t in mix.tasks:  # UL2: the denoiser tasks of each source
        source = t.name.split("_")[1]
        per_source[source] = per_source.get(source, 0) + mix.get_rate(t) / mix.total_rate
      assert per_source == pytest.approx(expected, abs=1e-9), name
  finally:  # the UL2 mixture keeps its rates as numbers: register the defaults again
    gin.clear_config()
    pipeline.tasks.register_tasks()
