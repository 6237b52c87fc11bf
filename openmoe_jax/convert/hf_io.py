"""Hugging Face checkpoint folders: sharded safetensors, config.json, tokenizer.

Writing streams tensors into shards of at most `max_shard_bytes` (transformers'
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, or a single
`model.safetensors`); reading opens tensors lazily, one at a time.
"""
import json
import os
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from openmoe_jax.convert.layout import ConversionError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def write_safetensors(output: str, tensors: Iterable[Tuple[str, np.ndarray]],
                      max_shard_bytes: int = 2 << 30,
                      progress=lambda _: None) -> List[str]:
  """Writes `tensors` (streamed) as safetensors shards in `output`; returns the
  file names written."""
  os.makedirs(output, exist_ok=True)
  current: Dict[str, np.ndarray] = {}
  size, total = 0, 0
  temp_names: List[Tuple[str, List[str]]] = []

  def flush():
    nonlocal current, size
    if current:
      name = f"shard-{len(temp_names):05d}.partial"
      save_file(current, os.path.join(output, name), metadata={"format": "pt"})
      temp_names.append((name, list(current)))
      progress(f"  wrote shard {len(temp_names)} ({size / 2**20:.0f} MiB)")
    current, size = {}, 0

  for name, array in tensors:
    array = np.ascontiguousarray(array)
    if current and size + array.nbytes > max_shard_bytes:
      flush()
    current[name] = array
    size += array.nbytes
    total += array.nbytes
  flush()
  if len(temp_names) == 1:
    os.replace(os.path.join(output, temp_names[0][0]), os.path.join(output, SINGLE))
    return [SINGLE]
  n = len(temp_names)
  weight_map, files = {}, []
  for i, (temp, names) in enumerate(temp_names):
    final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    os.replace(os.path.join(output, temp), os.path.join(output, final))
    weight_map.update({name: final for name in names})
    files.append(final)
  with open(os.path.join(output, INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return files + [INDEX]


class SafetensorsReader:
  """The tensors of a Hugging Face folder, read one at a time as float32 numpy."""

  def __init__(self, directory: str):
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
      with open(index) as f:
        self._file_of = dict(json.load(f)["weight_map"])
    elif os.path.isfile(os.path.join(directory, SINGLE)):
      with safe_open(os.path.join(directory, SINGLE), framework="numpy") as f:
        self._file_of = {k: SINGLE for k in f.keys()}
    else:
      raise ConversionError(f"{directory} holds no {SINGLE} and no {INDEX}: not a "
                            "Hugging Face safetensors checkpoint")
    self.directory = directory
    for name in sorted(set(self._file_of.values())):
      if not os.path.isfile(os.path.join(directory, name)):
        raise ConversionError(f"{directory}/{name} is missing (named in {INDEX})")

  @property
  def names(self) -> List[str]:
    """Returns every tensor name in the checkpoint."""
    return list(self._file_of)

  def read(self, name: str) -> np.ndarray:
    """Returns tensor `name` as float32 numpy."""
    with safe_open(os.path.join(self.directory, self._file_of[name]),
                   framework="numpy") as f:
      return np.asarray(f.get_tensor(name), np.float32)


def read_config(directory: str) -> Dict:
  """Returns `directory`/config.json."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise ConversionError(f"{path} is missing")
  with open(path) as f:
    return json.load(f)


def write_config(output: str, config: Dict) -> None:
  """Writes config.json."""
  with open(os.path.join(output, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)


def write_tokenizer(output: str, vocabulary, max_length: Optional[int] = None) -> List[str]:
  """Writes the SentencePiece model of a seqio vocabulary (sentinels included) as
  `tokenizer.model` plus the files transformers reads to load it; returns them.

  transformers' `SentencePieceBackend` (legacy mode) encodes with the model itself,
  so ids equal ours; Llama/T5 tokenizer classes would convert the model to a
  `tokenizers` pipeline with its own normalisation and split code differently.
  Its `decode` drops byte-fallback pieces and edge whitespace: decode with
  `tokenizer.sp_model.decode(ids)` for byte-exact text.
  """
  with open(os.path.join(output, "tokenizer.model"), "wb") as f:
    f.write(vocabulary.sp_model)
  config = {
      "tokenizer_class": "SentencePieceBackend", "legacy": True,
      "clean_up_tokenization_spaces": False,
      "bos_token": None, "eos_token": vocabulary.tokenizer.id_to_piece(vocabulary.eos_id),
      "unk_token": vocabulary.tokenizer.id_to_piece(vocabulary.unk_id),
      "pad_token": vocabulary.tokenizer.id_to_piece(vocabulary.pad_id),
      "model_max_length": max_length or 1 << 30,
  }
  with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return ["tokenizer.model", "tokenizer_config.json"]
