"""A small embedded corpus built from the local Python installation.

Two sources, both available offline on any machine with Python:

- `code`: the standard library's `.py` files (no tests, no site-packages);
- `text`: English prose, `pydoc_data.topics` plus the docstrings of the stdlib
  modules (one document per module).

Each split of each source is one JSONL file (`{"id": ..., "text": ...}` per
line), so documents with newlines stay one line and the generic file task in
`openmoe_jax.tasks` reads them like any user JSONL data. Splits are assigned
by a hash of the document id (~2% validation), so they are disjoint and stable.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import inspect
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
from typing import Iterator

# Bump when the file format or the document selection changes: a new folder
# is built and stale caches are simply ignored.
CORPUS_VERSION = "v1"
SOURCES = ("code", "text")
SPLITS = ("train", "validation")

_MAX_FILE_BYTES = 200_000  # a few generated tables dominate otherwise
_MAX_CODE_BYTES = 24_000_000
_VALIDATION_PER_MILLE = 20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test",
              "__pycache__", "lib2to3", "turtledemo"}


def cache_dir() -> pathlib.Path:
  """Returns the root cache folder: $OPENMOE_JAX_CACHE or ~/.cache/openmoe_jax.

  Read at call time so tests can point it elsewhere after import.
  """
  root = os.environ.get("OPENMOE_JAX_CACHE")
  if root:
    return pathlib.Path(root).expanduser()
  return pathlib.Path.home() / ".cache" / "openmoe_jax"


def corpus_dir() -> pathlib.Path:
  """Returns the versioned folder that holds the corpus files."""
  return cache_dir() / f"corpus_{CORPUS_VERSION}"


@contextlib.contextmanager
def build_lock(name: str):
  """Holds an exclusive file lock under the cache dir (one builder at a time)."""
  root = cache_dir()
  root.mkdir(parents=True, exist_ok=True)
  with open(root / f".{name}.lock", "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def split_of(doc_id: str) -> str:
  """Returns "validation" for ~2% of ids (by md5), else "train"."""
  digest = hashlib.md5(doc_id.encode("utf-8")).digest()
  bucket = int.from_bytes(digest[:4], "little") % 1000
  return "validation" if bucket < _VALIDATION_PER_MILLE else "train"


def _stdlib_files() -> list[tuple[str, pathlib.Path]]:
  """Returns (relative path, path) of stdlib .py files, sorted, size-capped."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS
                         and not d.startswith("test"))
    for name in sorted(filenames):
      if name.endswith(".py") and not name.startswith("test_"):
        path = pathlib.Path(dirpath) / name
        found.append((path.relative_to(root).as_posix(), path))
  found.sort()
  kept, total = [], 0
  for rel, path in found:
    size = path.stat().st_size
    if size == 0 or size > _MAX_FILE_BYTES or total + size > _MAX_CODE_BYTES:
      continue
    kept.append((rel, path))
    total += size
  return kept


def _read_source(path: pathlib.Path) -> str | None:
  try:
    return path.read_text(encoding="utf-8")
  except (UnicodeDecodeError, OSError):
    return None


def _docstrings(source: str) -> str:
  """Returns the module's docstrings (module, classes, functions) joined."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return ""
  docs = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=False)
      # Short docstrings ("Return x.") add little prose and many lines.
      if doc and len(doc) >= 40:
        docs.append(inspect.cleandoc(doc))
  return "\n\n".join(docs)


def iter_documents() -> Iterator[tuple[str, str, str]]:
  """Yields (source, doc id, text) for the whole corpus in a fixed order."""
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top

  for key in sorted(pydoc_data.topics.topics):
    yield "text", f"topics/{key}", pydoc_data.topics.topics[key]
  for rel, path in _stdlib_files():
    source = _read_source(path)
    if not source or not source.strip():
      continue
    yield "code", f"stdlib/{rel}", source
    prose = _docstrings(source)
    if prose:
      yield "text", f"docstrings/{rel}", prose


def _file_name(source: str, split: str) -> str:
  return f"{source}.{split}.jsonl"


def _write(folder: pathlib.Path) -> None:
  """Writes all source/split files into `folder` (a private temp folder)."""
  buckets = {(s, p): [] for s in SOURCES for p in SPLITS}
  for source, doc_id, text in iter_documents():
    buckets[(source, split_of(doc_id))].append((doc_id, text))
  for (source, split), docs in buckets.items():
    # Store in hash order so even an unshuffled read mixes the packages.
    docs.sort(key=lambda d: hashlib.md5(d[0].encode("utf-8")).hexdigest())
    with open(folder / _file_name(source, split), "w", encoding="utf-8") as f:
      for doc_id, text in docs:
        f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False))
        f.write("\n")


def announce(message: str) -> None:
  """Prints a one-time build message (stderr: stdout may carry a program's output)."""
  print(message, file=sys.stderr, flush=True)


def ensure_corpus() -> pathlib.Path:
  """Builds the corpus if missing and returns its folder.

  Built under a file lock in a temp folder and renamed into place, so a
  concurrent reader sees either nothing or the complete corpus.
  """
  final = corpus_dir()
  if final.is_dir():
    return final
  with build_lock("corpus"):
    if final.is_dir():
      return final
    announce(f"Building the embedded corpus in {final} (first use only; later runs "
             "reuse it) ...")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".corpus_tmp_", dir=final.parent))
    try:
      _write(tmp)
      os.rename(tmp, final)
    finally:
      if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
  return final


def corpus_file(source: str, split: str) -> str:
  """Returns the path of one source/split JSONL file, building if needed."""
  if source not in SOURCES or split not in SPLITS:
    raise ValueError(f"unknown corpus file {source!r}/{split!r}")
  return str(ensure_corpus() / _file_name(source, split))


def read_documents(source: str, split: str) -> list[dict[str, str]]:
  """Returns the documents of one source/split as dicts with id and text."""
  with open(corpus_file(source, split), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def corpus_stats() -> dict[str, dict[str, int]]:
  """Returns {"source/split": {"docs": n, "bytes": file size}}."""
  stats = {}
  for source in SOURCES:
    for split in SPLITS:
      path = corpus_file(source, split)
      with open(path, encoding="utf-8") as f:
        docs = sum(1 for _ in f)
      stats[f"{source}/{split}"] = {"docs": docs,
                                    "bytes": os.path.getsize(path)}
  return stats
