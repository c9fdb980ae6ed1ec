"""`bert-mp prepare` through the real CLI in a process of its own (tests/forkserver.py): a hostile
corpus is prepared, each problem counted."""

from __future__ import annotations

import json
import subprocess
import sys

import forkserver
from support import write_corpus


def _cli(tmp_path, *args):
    """The real CLI in a process of its own (what a user runs)."""
    return forkserver.run(
        [sys.executable, "-m", "bert_mp", "prepare", *args, f"data.cache_dir={tmp_path / 'cache'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


def test_cli_prepares_hostile_corpus_with_counted_handling(tmp_path):
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    write_corpus(hostile / "normal.txt", n_docs=40)
    (hostile / "empty.txt").write_text("")
    (hostile / "binary.txt").write_bytes(bytes(range(256)) * 20)
    (hostile / "latin1.txt").write_bytes(
        "Caf\xe9 cr\xe8me. Na\xefve text here.\r\n\r\nSecond doc. Yes.".encode("latin-1")
    )
    (hostile / "crlf.txt").write_bytes(b"Line one.\r\nLine two.\r\n\r\nDoc two.\rMore.\r\r")
    (hostile / "rtl_cjk.txt").write_text(
        "مرحبا بالعالم. هذا نص.\n\n你好世界。这是一个测试。\n\nשלום עולם. עוד משפט."
    )
    (hostile / "long_line.txt").write_text(("word " * 400_000).strip())  # 2 MB, one line
    (hostile / "one_word_docs.txt").write_text("\n\n".join(["Hello"] * 30))
    r = _cli(
        tmp_path, "data.source=text", "data.paths=[hostile]", "data.vocab_size=300", "data.max_seq_length=32"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    path = next(p for p in (tmp_path / "cache").iterdir() if (p / "PREPARED").exists())
    s = json.loads((path / "stats.json").read_text())
    assert s["documents"]["invalid_utf8_replaced"] > 0
    assert sum(v["sentences_cut_to_max_length"] for v in s["per_split"].values()) > 0  # the 2 MB line is used
    assert s["documents"]["files_empty"] and s["documents"]["files"] == 8
    # the binary file is skipped and named, not read as text full of U+FFFD
    assert s["documents"]["binary_files"] == 1 and s["documents"]["first_binary_file"].endswith("binary.txt")
    assert any("look binary" in w for w in s["warnings"])
    assert s["splits"]["train"] > 0
    assert "NSP random share" in r.stdout and "documents:" in r.stdout


def test_two_fresh_prepares_of_the_same_corpus_are_identical(tmp_path):
    """No tokenizer given: each prepare trains its own WordPiece vocabulary (separate caches, other
    hash seeds) on a sample of a third of the corpus, and still writes the same tokenizer and the
    same examples."""
    import os

    from bert_mp.data.prepare import load_prepared

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        write_corpus(corpus / f"{i}.txt", n_docs=20, seed=i)
    outputs = []
    for run, seed in (("one", "1"), ("two", "2")):
        r = forkserver.run(
            [sys.executable, "-m", "bert_mp", "prepare", "data.source=text", f"data.paths=[{corpus}]"]
            + ["data.vocab_size=400", "data.max_seq_length=64", f"data.cache_dir={tmp_path / run}"]
            + ["data.vocab_sample_chars=10000"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        path = next(p for p in (tmp_path / run).iterdir() if (p / "PREPARED").exists())
        prepared = load_prepared(path)
        sample = prepared.stats["vocabulary"]
        assert not sample["whole"] and sample["characters"] < sample["of_characters"] / 2
        assert f"a sample of {sample['documents']} of {sample['of_documents']} training documents" in r.stdout
        train = prepared.dataset["train"]
        outputs.append((prepared.tokenizer.get_vocab(), train["input_ids"], train["next_sentence_label"]))
    assert outputs[0][0] == outputs[1][0]
    assert outputs[0][1] == outputs[1][1] and outputs[0][2] == outputs[1][2]
    assert len(outputs[0][1]) > 20


def test_prepare_loads_no_torch(tmp_path):
    """`bert-mp prepare` is text, tokens and Arrow: it does not pay for importing torch."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus / "a.txt", n_docs=20)
    code = (
        "import sys\n"
        "from bert_mp.cli import main\n"
        f"code = main(['prepare', 'data.source=text', 'data.paths=[{corpus}]', 'data.vocab_size=300',\n"
        f"             'data.max_seq_length=32', 'data.cache_dir={tmp_path / 'cache'}'])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "0 False"
