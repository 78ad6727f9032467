import json
import sysconfig
from pathlib import Path

import pytest

from k3.data import Document, leading_documents, load_documents, stdlib_documents


def test_stdlib_corpus_full():
    docs = stdlib_documents()
    ids = [d.id for d in docs]
    assert len(docs) > 100
    assert sum(len(d.text.encode("utf-8")) for d in docs) > 5_000_000
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(d.text for d in docs) and all(i.endswith(".py") for i in ids)
    assert not any(part in ("site-packages", "dist-packages") for i in ids for part in Path(i).parts)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert docs[0].text == (root / docs[0].id).read_text(encoding="utf-8", errors="replace")


def test_stdlib_corpus_subset_deterministic():
    a, b = stdlib_documents(max_bytes=500_000), stdlib_documents(max_bytes=500_000)
    assert a == b and len(a) > 1
    assert sum(len(d.text.encode("utf-8")) for d in a) <= 500_000
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_documents(max_bytes=0)


def test_load_text_file(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("once upon a time\n", encoding="utf-8")
    assert load_documents(f) == [Document("book.txt", "once upon a time\n")]
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt"):
        load_documents(tmp_path / "empty.txt")


def test_load_directory(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "z.md").write_text("# z")
    (tmp_path / "b" / "a.py").write_text("x = 1\n")
    (tmp_path / "b" / "c.rst").write_text("title\n=====\n")
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "data.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".git" / "HEAD.txt").write_text("hidden")
    docs = load_documents(tmp_path)
    assert [d.id for d in docs] == ["a.txt", "b/a.py", "b/c.rst", "z.md"]
    assert docs[1].text == "x = 1\n"


def test_load_directory_without_text(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"\x00")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_documents(tmp_path)


def test_load_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        load_documents(tmp_path / "nowhere.txt")


def test_load_jsonl(tmp_path):
    f = tmp_path / "c.jsonl"
    rows = [{"text": "first"}, {"text": "naïve 世界", "id": "doc-7"}, {"text": ""}, {"text": "third", "meta": 1}]
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:]))
    docs = load_documents(f)
    assert docs == [Document("c.jsonl:1", "first"), Document("doc-7", "naïve 世界"), Document("c.jsonl:5", "third")]


@pytest.mark.parametrize("bad,what", [('{"txt": "x"}', 'no "text" field'), ('{"text": 3}', "int"),
                                      ('["text"]', "list"), ('{"text": "x"', "not valid JSON")])
def test_load_jsonl_bad_line(tmp_path, bad, what):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "ok"}\n' + bad + "\n")
    with pytest.raises(ValueError) as e:
        load_documents(f)
    assert "bad.jsonl:3" in str(e.value) and what in str(e.value)


def test_leading_documents_stop_at_the_one_that_reaches_the_budget():
    docs = [Document(str(i), "x" * n) for i, n in enumerate([3, 4, 5, 6])]
    assert [d.id for d in leading_documents(docs, 7)] == ["0", "1"]  # 3 + 4 reaches 7
    assert [d.id for d in leading_documents(docs, 8)] == ["0", "1", "2"]  # the one that crosses is kept whole
    assert [d.id for d in leading_documents(docs, 100)] == ["0", "1", "2", "3"]
