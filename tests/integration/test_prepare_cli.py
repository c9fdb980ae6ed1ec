"""`bert-mp prepare` through the real CLI in a process of its own (tests/forkserver.py): a hostile
corpus is prepared, each problem counted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
from support import hold_env, start_cli, wait_held, write_corpus


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
    outputs, fingerprints = [], []
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
        fingerprints.append(prepared.stats["fingerprint"])
    assert (
        fingerprints[0] == fingerprints[1]
    )  # of the data alone: two folders, two processes, one fingerprint
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


# --------------------------------------------------------------------------------------------------
# one builder per cache folder
# --------------------------------------------------------------------------------------------------
BUILD = ["data.source=text", "data.paths=[corpus]", "data.vocab_size=300", "data.max_seq_length=32"]


def _start_held(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A prepare of BUILD into cache/, held once its tokenizer is written (it holds the builder's lock)."""
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus" / "a.txt", n_docs=60)
    ready = tmp_path / "held"
    env = {**os.environ, **hold_env("tokenizer:written", ready)}  # the server _cli forks from
    proc = start_cli("prepare", *BUILD, "data.cache_dir=cache", cwd=tmp_path, env=env)
    wait_held(proc, ready)
    return proc, ready


def _built(cache: Path) -> Path:
    (folder,) = [p for p in cache.iterdir() if (p / "PREPARED").exists()]
    return folder


def test_two_prepares_of_one_key_started_together_build_once(tmp_path):
    """The second waits for the first with one line naming it (the order is the test's: the first is
    held inside its build), then reuses its folder; with data.build_wait_s it stops in one line."""
    first, ready = _start_held(tmp_path)
    second = start_cli("prepare", *BUILD, "data.cache_dir=cache", cwd=tmp_path, env=dict(os.environ))
    line = second.stdout.readline()  # blocks until the second says it waits (or ends)
    assert line.startswith(f"bert-mp prepare: waiting for pid {first.pid} on "), (line, second.stderr.read())
    assert "`bert-mp prepare data.source=text" in line and "to finish building cache/" in line
    hurry = _cli(tmp_path, *BUILD, "data.build_wait_s=0.2")  # (the same key: cache_dir is not in it)
    assert hurry.returncode == 2, hurry.stderr[-2000:]
    assert hurry.stderr.strip().startswith("bert-mp prepare: error: ") and "\n" not in hurry.stderr.strip()
    assert (
        f"is still being built by pid {first.pid} on " in hurry.stderr
        and "data.build_wait_s=0.2 s" in hurry.stderr
    )
    ready.unlink()  # the first goes on
    out1, err1 = first.communicate(timeout=300)
    out2, err2 = second.communicate(timeout=300)
    assert first.returncode == 0 and second.returncode == 0, (err1[-2000:], err2[-2000:])
    folder = _built(tmp_path / "cache")
    assert f"reusing cache/{folder.name}, built meanwhile by pid {first.pid} on " in out2
    assert "prepared" in out1 and "prepared" not in out2  # one build: the summary once
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [folder.name, "tokenizers"]


def test_a_builder_killed_leaves_nothing_half_used_and_the_next_one_takes_over(tmp_path):
    first, _ = _start_held(tmp_path)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    cache = tmp_path / "cache"
    left = sorted(p.name for p in cache.iterdir())
    assert any(n.startswith(".tmp-") for n in left) and not any(
        (cache / n / "PREPARED").exists() for n in left
    )
    again = _cli(tmp_path, *BUILD)  # into cache/: the lock died with its holder
    assert again.returncode == 0 and "waiting" not in again.stdout, again.stderr[-3000:]
    folder = _built(cache)
    assert sorted(p.name for p in cache.iterdir()) == [
        folder.name,
        "tokenizers",
    ]  # the dead build's folder gone
    clean = forkserver.run(
        [sys.executable, "-m", "bert_mp", "prepare", *BUILD, "data.cache_dir=clean"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert clean.returncode == 0, clean.stderr[-3000:]
    fingerprint = json.loads((folder / "stats.json").read_text())["fingerprint"]
    assert fingerprint == json.loads((_built(tmp_path / "clean") / "stats.json").read_text())["fingerprint"]
