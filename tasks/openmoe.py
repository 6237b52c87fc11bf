"""OpenMoE's pre-training data mixtures (versions I, II, III) over real sources.

Sources (RedPajama-1T subsets, Wikipedia, The Stack dedup) default to TFDS
datasets read lazily: nothing touches disk or network until a batch is asked
for. TFDS has no RedPajama / The Stack builders: the default names are those
of builders you prepare (`tfds build`, or `huggingface:` community builders);
point any source elsewhere through gin, e.g. JSONL shards on GCS:

    openmoe_sources.sources = {"rp_arxiv": @arxiv/text_files()}
    arxiv/text_files.split_to_filepattern = {"train": "gs://b/arxiv/*.jsonl"}

Registered (by `register_tasks`): one task per source `openmoe_<source>`
(causal LM) and `openmoe_<source>_ul2` (UL2 mixture of denoisers), and the
mixtures `openmoe_v1`, `openmoe_v2`, `openmoe_v3` and their `_ul2` versions.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import gin
import seqio

from openmoe_jax.data import sources as sources_lib
from openmoe_jax.tasks import builders

PREFIX = "openmoe_"
UL2_SUFFIX = "_ul2"

# Relative example rates from OpenMoE's t5x gin files (github.com/XueFuzhao/t5x;
# the data versions of Xue et al. 2024, OpenMoE, arXiv:2402.01739). Version I was
# all RedPajama (its wikipedia is RedPajama's) plus The Stack; II and III add
# a separate Wikipedia ("wiki") beside RedPajama's ("rp-wiki").
OPENMOE_MIXTURES: dict[str, dict[str, float]] = {
    "v1": {"rp_c4": 15, "rp_wikipedia": 4.5, "rp_stackexchange": 2,
           "rp_arxiv": 2.5, "rp_book": 4.5, "rp_github": 4.5,
           "rp_common_crawl": 67, "the_stack_dedup": 100},
    "v2": {"rp_c4": 15, "rp_wikipedia": 6.5, "wikipedia": 6.5,
           "rp_stackexchange": 2.5, "rp_arxiv": 4.5, "rp_book": 6.5,
           "rp_github": 5, "rp_common_crawl": 43.5, "the_stack_dedup": 10},
    "v3": {"rp_c4": 15, "rp_wikipedia": 4.5, "wikipedia": 2.5,
           "rp_stackexchange": 1, "rp_arxiv": 4.5, "rp_book": 4.5,
           "rp_github": 5, "rp_common_crawl": 33, "the_stack_dedup": 30},
}

# source -> (TFDS name:version, text feature); seqio needs the version.
# Placeholders for builders you prepare (wikipedia is a real TFDS builder).
DEFAULT_TFDS = {
    "rp_c4": ("redpajama_1t/c4:1.0.0", "text"),
    "rp_wikipedia": ("redpajama_1t/wikipedia:1.0.0", "text"),
    "rp_stackexchange": ("redpajama_1t/stackexchange:1.0.0", "text"),
    "rp_arxiv": ("redpajama_1t/arxiv:1.0.0", "text"),
    "rp_book": ("redpajama_1t/book:1.0.0", "text"),
    "rp_github": ("redpajama_1t/github:1.0.0", "text"),
    "rp_common_crawl": ("redpajama_1t/common_crawl:1.0.0", "text"),
    "wikipedia": ("wikipedia/20230601.en:1.0.0", "text"),
    "the_stack_dedup": ("the_stack_dedup:1.0.0", "content"),
}
# RedPajama and The Stack ship one split: hold out 1% for validation.
DEFAULT_SPLITS = {"train": "train[1%:]", "validation": "train[:1%]"}


@gin.configurable
def openmoe_sources(
    sources: Optional[Mapping[str, sources_lib.Source]] = None,
    tfds_names: Optional[Mapping[str, str]] = None,
    tfds_data_dir: Optional[str] = None,
    tfds_splits: Mapping[str, str] = DEFAULT_SPLITS,
) -> dict[str, sources_lib.Source]:
  """Returns a Source for every name in DEFAULT_TFDS.

  `sources` replaces any of them (e.g. `@text_files()` over gs:// JSONL);
  the others are TFDS datasets, named by `tfds_names` or DEFAULT_TFDS, read
  from `tfds_data_dir` (gs:// ok) with `tfds_splits`.
  """
  out = {}
  for name, (tfds_name, feature) in DEFAULT_TFDS.items():
    tfds_name = (tfds_names or {}).get(name, tfds_name)
    out[name] = sources_lib.tfds_dataset(tfds_name, feature, tfds_splits,
                                         tfds_data_dir)
  unknown = set(sources or {}) - set(out)
  if unknown:
    raise ValueError(f"unknown OpenMoE sources {sorted(unknown)}; "
                     f"known: {sorted(out)}")
  out.update(sources or {})
  return out


def mixture_rates(version: str) -> dict[str, float]:
  """Returns the normalised example rates of mixture `version` ("v1".."v3")."""
  weights = OPENMOE_MIXTURES[version]
  total = sum(weights.values())
  return {name: w / total for name, w in weights.items()}


@gin.configurable
def register_openmoe_mixtures(
    vocabulary: Optional[seqio.Vocabulary] = None,
    versions: Sequence[str] = tuple(OPENMOE_MIXTURES),
    objectives: Sequence[str] = ("lm", "ul2"),
) -> list[str]:
  """Registers the source tasks and OpenMoE mixtures; returns their names.

  `vocabulary` None is the corpus vocabulary; OpenMoE used umT5's
  (`@umt5/sentencepiece_vocabulary()` with extra_ids = 300).
  """
  sources = openmoe_sources()
  used = sorted({s for v in versions for s in OPENMOE_MIXTURES[v]})
  names = []
  for objective in objectives:
    suffix = UL2_SUFFIX if objective == "ul2" else ""
    for source in used:
      builders.make_source_task(PREFIX + source + suffix, sources[source],
                             vocabulary, objective=objective)
      names.append(PREFIX + source + suffix)
    for version in versions:
      mixture = PREFIX + version + suffix
      seqio.MixtureRegistry.remove(mixture)
      seqio.MixtureRegistry.add(mixture, [
          (PREFIX + source + suffix, rate)
          for source, rate in mixture_rates(version).items()])
      names.append(mixture)
  return names
