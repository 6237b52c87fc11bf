"""Which files and docstrings the embedded corpus takes (data/corpus.py), on a
stand-in standard library. (The other tests read the cached corpus, built once,
which hides the selection from them.)"""
import hashlib
import json
import sysconfig

from openmoe_jax.data import corpus

from run_files import write_file


def _write(root, files):
  for rel, text in files.items():
    write_file(root / rel, text)


def test_stdlib_files_skip_tests_site_packages_empty_and_large_files(tmp_path,
                                                                    monkeypatch):
  """Sorted by path; test folders and test_ files, skipped folders and empty or
  oversized files are left out; files stop being added once the total would pass
  the cap (a later, smaller file still fits)."""
  _write(tmp_path, {
      "b.py": "b" * 10, "a.py": "a" * 30, "pkg/c.py": "c" * 40,
      "pkg/test_c.py": "t", "tests/d.py": "d", "testing/e.py": "e",
      "site-packages/f.py": "f", "__pycache__/g.py": "g", "empty.py": "",
      "big.py": "x" * 51, "edge.py": "e" * 50, "notes.txt": "n", "z.py": "z" * 20,
      "zz.py": "z" * 10})
  monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
  monkeypatch.setattr(corpus, "_MAX_FILE_BYTES", 50)
  monkeypatch.setattr(corpus, "_MAX_CODE_BYTES", 140)
  kept = corpus._stdlib_files()  # pylint: disable=protected-access
  # a 30 + b 10 + edge 50 (the file limit itself) + pkg/c 40 = 130; z (20) would
  # pass the cap of 140, zz (10) reaches it exactly.
  assert [rel for rel, _ in kept] == ["a.py", "b.py", "edge.py", "pkg/c.py", "zz.py"]
  assert all(path == tmp_path / rel for rel, path in kept)


def test_docstrings_keep_the_long_ones_of_modules_classes_and_functions():
  long = "A docstring of forty characters or more."
  assert len(long) == 40
  source = (f'"""{long}"""\n'
            f'class C:\n  """{long} (class)"""\n'
            f'  def f(self):\n    """{long} (method)"""\n'
            f'async def g():\n  """{long} (async)"""\n'
            f'def h():\n  """{long[:39]}"""\n')
  got = corpus._docstrings(source)  # pylint: disable=protected-access
  # ast.walk's breadth-first order: the module's own nodes before the method.
  assert got.split("\n\n") == [long, f"{long} (class)", f"{long} (async)",
                               f"{long} (method)"]
  assert corpus._docstrings("def (:") == ""  # pylint: disable=protected-access


def test_two_percent_of_ids_go_to_validation_by_their_md5():
  ids = [f"doc/{i}" for i in range(20000)]
  share = sum(corpus.split_of(i) == "validation" for i in ids) / len(ids)
  assert 0.017 < share < 0.023
  buckets = set()
  for doc_id in ids:
    bucket = int.from_bytes(hashlib.md5(doc_id.encode()).digest()[:4], "little") % 1000
    buckets.add(bucket)
    assert corpus.split_of(doc_id) == ("validation" if bucket < 20 else "train")
  assert 20 in buckets  # the boundary is seen


def test_each_document_is_written_to_its_source_and_split_in_hash_order(
    tmp_path, monkeypatch):
  ids = [f"doc/{i}" for i in range(2000)]
  docs = [("code" if i % 2 else "text", doc_id, f"é {doc_id}\nline 2")
          for i, doc_id in enumerate(ids)]
  monkeypatch.setattr(corpus, "iter_documents", lambda: iter(docs))
  corpus._write(tmp_path)  # pylint: disable=protected-access
  seen = []
  for source in corpus.SOURCES:
    for split in corpus.SPLITS:
      path = tmp_path / f"{source}.{split}.jsonl"
      text = path.read_text(encoding="utf-8")
      assert "é" in text  # UTF-8, not \\u escapes
      rows = [json.loads(line) for line in text.splitlines()]
      assert rows, (source, split)
      got_ids = [row["id"] for row in rows]
      assert got_ids == sorted(got_ids, key=lambda i: hashlib.md5(i.encode()).hexdigest())
      for row in rows:
        assert corpus.split_of(row["id"]) == split
        assert ("code" if int(row["id"][4:]) % 2 else "text") == source
        assert row["text"] == f"é {row['id']}\nline 2"
      seen += got_ids
  assert sorted(seen) == sorted(ids)
