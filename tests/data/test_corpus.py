import json
import re
import sysconfig
from pathlib import Path

import pytest

from k3.data import Document, leading_documents, load_documents, stdlib_documents
from k3.data.corpus import split_text


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


def test_split_text_cuts_at_blank_lines_and_loses_nothing():
    paras = [f"paragraph {i}: " + "word " * (i * 7 % 30) + "\n" for i in range(40)]  # each < 170 characters
    prose = "\n".join(paras) + "\n \t\n"
    text = prose + "x" * 450 + "\n" + "y" * 50
    for max_chars in (64, 200, 1000, len(text)):
        pieces = split_text(text, max_chars)
        assert all(len(p) <= max_chars and p.strip() for p in pieces)
        # nothing is lost but whitespace-only pieces at a cut (64 < some paragraphs + their blank line)
        squeeze = lambda t: "".join(t.split())  # noqa: E731
        assert "".join(pieces) == text if max_chars >= 200 else squeeze("".join(pieces)) == squeeze(text)
    pieces = split_text(text, 200)
    prose_pieces = pieces[:len(split_text(prose, 200))]
    assert "".join(prose_pieces) == prose  # the prose is cut at its paragraph breaks only
    assert all(re.search(r"\n[ \t]*\n\s*$", p) for p in prose_pieces)
    assert pieces[len(prose_pieces):] == ["x" * 200, "x" * 200, "x" * 50 + "\n", "y" * 50]  # a long line: anywhere
    assert split_text(text, len(text)) == [text]
    with pytest.raises(ValueError, match="max_chars"):
        split_text(text, 0)


def test_long_files_become_several_documents(tmp_path):
    book = tmp_path / "book.txt"
    text = "".join(f"Chapter {i}. " + "It was a dark and stormy night. " * 20 + "\n\n" for i in range(30))
    book.write_text(text)
    docs = load_documents(book, max_chars=2000)
    assert len(docs) > 1 and "".join(d.text for d in docs) == text
    assert [d.id for d in docs] == [f"book.txt#{i}" for i in range(len(docs))]
    assert load_documents(book) == [Document("book.txt", text)]  # None: every document whole
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": text, "id": "long"}) + "\n" + json.dumps({"text": "short"}) + "\n")
    docs = load_documents(rows, max_chars=2000)
    assert docs[0].id == "long#0" and docs[-1] == Document("rows.jsonl:2", "short")


def test_binary_and_non_utf8_data_is_refused_naming_the_file(tmp_path):
    """Random bytes or an executable would train on replacement characters; the file is named with what to do."""
    blob = tmp_path / "model.bin"
    blob.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(ValueError, match=r"model.bin is a binary file, not text \(a NUL byte at offset 0\); "
                                         "--data takes UTF-8 text"):
        load_documents(blob)
    latin = tmp_path / "d" / "sub" / "old.txt"
    latin.parent.mkdir(parents=True)
    latin.write_bytes("café\n".encode("latin1"))
    (tmp_path / "d" / "good.txt").write_text("fine text\n")
    with pytest.raises(ValueError, match=r"old.txt is not UTF-8 text \(byte 0xe9 at offset 3\); convert it, e.g. "
                                         "iconv -f latin1 -t utf-8"):
        load_documents(tmp_path / "d")  # one bad file in a directory is named, not silently replaced


def test_jsonl_encoding_errors_and_lone_surrogates_name_file_and_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: not UTF-8 text \(byte 0xe9 at column 14\)"):
        load_documents(p)
    p.write_text('{"text": "fine"}\n\n{"text": "a \\ud83d\\ude00 pair is fine"}\n{"text": "lone \\ud800 here"}\n')
    with pytest.raises(ValueError, match=r'c.jsonl:4: a lone surrogate \\ud800 in "text" \(at character 5\) is not '
                                         "Unicode text; remove that escape"):
        load_documents(p)
