"""Hostile usage through the real CLI (``python -m bert_mp`` in a process of its own per case, as a
user runs it: tests/forkserver.py).

Each case asserts the exit code, that stderr is the one documented line (no traceback), and that
nothing on disk changed where nothing should (paths, sizes and modification times). The cases share
one small project, built once: a text corpus, a fixed tokenizer, its prepared data and a finished
2-step run with its export (docs/usage.md, "What a mistake does", names each test).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import hold_env, make_tokenizer, run_cli, start_cli, wait_held

from bert_mp.core.config import load_config
from bert_mp.pretrain.trainer import train

DATA = [
    "data.source=text",
    "data.paths=[corpus/a.txt]",
    "data.tokenizer=tok",
    "data.max_seq_length=32",
    "data.validation_fraction=0.1",
    "data.cache_dir=data",
]
MODEL = ["model.hidden_size=32", "model.num_attention_heads=2", "model.intermediate_size=64"]
TRAIN = [
    *DATA,
    *MODEL,
    "train.output_dir=run",
    "train.max_steps=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.eval_max_batches=1",
    "train.progress_bar=false",
]
QUIET = {"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
"""No progress bars on stderr, so the interruption line is all there is."""


def write_corpus(path: Path, n_docs: int, seed: int = 0) -> Path:
    """Documents (blank-line separated) of 2-8 sentences over the fixed tokenizer's words w0..w58."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [
            " ".join(f"w{rng.randrange(59)}" for _ in range(rng.randint(4, 12))) + "."
            for _ in range(rng.randint(2, 8))
        ]
        docs.append(" ".join(sentences))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """corpus/a.txt, tok/, data/<key>/ (prepared) and run/ (2 steps, checkpoint and final/)."""
    root = tmp_path_factory.mktemp("project")
    write_corpus(root / "corpus" / "a.txt", 120)
    make_tokenizer().save_pretrained(str(root / "tok"))
    cwd = os.getcwd()
    os.chdir(root)  # the paths in TRAIN are relative (contextlib.chdir is Python 3.11+)
    try:
        summary = train(load_config(None, TRAIN))
    finally:
        os.chdir(cwd)
    assert summary["status"] == "completed" and (root / "run" / "final" / "config.json").is_file()
    return root


@pytest.fixture
def copy(project, tmp_path) -> Path:
    """A private copy of the project, for the cases that change it."""
    dst = tmp_path / "p"
    shutil.copytree(project, dst)
    return dst


def snapshot(*roots: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under ``roots`` with its size and mtime (None: the root does not exist)."""
    out: dict[str, tuple[int, int] | None] = {}
    for root in roots:
        out[str(root)] = None
        if root.exists():
            for p in [root, *sorted(root.rglob("*"))]:
                st = p.stat()
                out[str(p)] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return out


def one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The single non-empty stderr line of a command that exited with ``code``."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code and len(lines) == 1, (
        proc.returncode,
        proc.stdout[-2000:],
        proc.stderr[-4000:],
    )
    assert "Traceback" not in proc.stderr
    return lines[0]


def start(args: list[str], cwd: Path, **env: str | None) -> subprocess.Popen:
    """``python -m bert_mp ARGS`` in its own session (a terminal's process group), offline unless
    ``env`` unsets it (a value None removes the variable)."""
    full = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return start_cli(*args, cwd=cwd, env=full)  # killed with its group when the test ends, however it ends


def session_processes(sid: int) -> list[str]:
    """``pid comm`` of the live processes in session ``sid`` (a command and everything it forked)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if int(rest[3]) == sid and rest[0] != "Z":  # fields after comm: state ppid pgrp session
            found.append(f"{stat.parent.name} {comm}")
    return found


def session_ends(sid: int, timeout: float = 10.0) -> list[str]:
    """Wait (up to ``timeout``) for every process of session ``sid`` to end; those left."""
    import psutil

    procs = []
    for entry in session_processes(sid):
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(int(entry.split()[0])))
    psutil.wait_procs(procs, timeout=timeout)
    return session_processes(sid)


# --------------------------------------------------------------------------------------------------
# Ctrl-C / SIGTERM
# --------------------------------------------------------------------------------------------------
@pytest.mark.signals
@pytest.mark.parametrize(
    ("sig", "kill"),
    [(signal.SIGINT, os.killpg), (signal.SIGTERM, os.killpg), (signal.SIGTERM, os.kill)],
    ids=["ctrl-c", "SIGTERM-to-the-group", "SIGTERM-to-the-command"],
)
def test_prepare_interrupted_while_pairing_is_one_line_and_leaves_nothing(tmp_path, sig, kill):
    """Ctrl-C (or a SIGTERM) reaches every process of the group, or a SIGTERM only the command: the
    pairing pool's workers (num_proc=2) print nothing, the command prints one line and
    exits 128 + signal, no worker or manager process is left behind (before, a SIGTERM to the
    command alone left its workers pairing on), and no prepared folder, complete-looking or
    partial, remains. The command holds once a block is paired; the signal lands there."""
    write_corpus(tmp_path / "corpus" / "a.txt", 3000, seed=1)  # many blocks: the pool is busy
    make_tokenizer().save_pretrained(str(tmp_path / "tok"))
    args = ["prepare", *DATA, "data.num_proc=2", "data.pairing_block_chars=20000"]
    ready = tmp_path / "held"
    proc = start(args, tmp_path, **QUIET, **hold_env("prepare:paired", ready))
    wait_held(proc, ready)
    kill(proc.pid, sig)  # killpg: what a terminal does on Ctrl-C (and `kill -TERM -PGID`)
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 128 + sig and "Traceback" not in err and len(lines) == 1, (out, err)
    key = load_config(None, args[1:]).data.cache_key()
    assert lines[0] == f"bert-mp prepare: interrupted ({sig.name}); nothing written to data/{key}"
    assert session_ends(proc.pid) == []  # no orphaned pool worker or manager
    assert [p.name for p in (tmp_path / "data").iterdir()] == []  # neither the folder nor its build


@pytest.mark.signals
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_ctrl_c_during_training_saves_a_checkpoint_and_exits_130(copy, debug):
    """Ctrl-C (SIGINT to the whole group) through the CLI, held after step 2; with --debug too (one
    line, no traceback). SIGTERM: test_checkpoint_processes.py."""
    ready = copy / "held"
    flags = ["--debug"] if debug else []
    args = [*flags, "train", *TRAIN, "train.output_dir=long", "train.max_steps=100000"]
    proc = start(args, copy, **hold_env("step:2", ready))
    wait_held(proc, ready)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip() == "", (out, err)
    summary = json.loads((copy / "long" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stop_reason"] == "signal SIGINT"
    assert summary["steps"] in (2, 3)  # the step under way when the signal landed is finished
    saved = sorted(p.name for p in (copy / "long" / "checkpoints").iterdir())
    assert saved == [f"step_{summary['steps']:08d}"]
    stopped = f"bert-mp train: stopped after {summary['steps']} steps (signal SIGINT; checkpoint saved)"
    assert f"{stopped} -> long; continue it with the same command and train.resume=latest" in out


@pytest.mark.signals
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "SIGTERM"])
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_train_interrupted_while_preparing_names_train(tmp_path, sig, debug):
    """``bert-mp train`` prepares its data first: an interruption there is one ``bert-mp train:``
    line (Ctrl-C and SIGTERM alike, with or without --debug), exit 128 + signal, nothing left."""
    write_corpus(tmp_path / "corpus" / "a.txt", 3000, seed=1)
    make_tokenizer().save_pretrained(str(tmp_path / "tok"))
    args = [*TRAIN, "data.num_proc=2", "data.pairing_block_chars=20000"]
    ready = tmp_path / "held"
    flags = ["--debug"] if debug else []
    proc = start([*flags, "train", *args], tmp_path, **QUIET, **hold_env("prepare:paired", ready))
    wait_held(proc, ready)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 128 + sig and "Traceback" not in err and len(lines) == 1, (out, err)
    key = load_config(None, args).data.cache_key()
    assert lines[0] == f"bert-mp train: interrupted ({sig.name}); nothing written to data/{key}"
    assert session_ends(proc.pid) == []
    assert [p.name for p in (tmp_path / "data").iterdir()] == []
    assert not (tmp_path / "run").exists()


@pytest.mark.signals
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "SIGTERM"])
def test_interrupt_while_the_tokenizer_is_written_leaves_no_temporary_folder(tmp_path, sig):
    """A tokenizer trained by ``bert-mp train``'s data preparation, interrupted while written to its
    temporary folder: one ``bert-mp train:`` line and no ``.tmp-*`` folder (nor anything else)."""
    write_corpus(tmp_path / "corpus" / "a.txt", 200, seed=2)
    args = [a for a in TRAIN if not a.startswith("data.tokenizer=")] + ["data.vocab_size=128"]
    ready = tmp_path / "held"
    proc = start(["train", *args], tmp_path, **QUIET, **hold_env("tokenizer:written", ready))
    wait_held(proc, ready)
    assert [p.name[:5] for p in (tmp_path / "data" / "tokenizers").iterdir()] == [".tmp-"]
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 128 + sig and len(lines) == 1 and "Traceback" not in err, (out, err)
    assert lines[0].startswith(f"bert-mp train: interrupted ({sig.name}); nothing written to data/")
    assert list((tmp_path / "data" / "tokenizers").iterdir()) == []
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["tokenizers"]


# --------------------------------------------------------------------------------------------------
# runs and data that must not be silently reused or changed
# --------------------------------------------------------------------------------------------------
def test_prepare_force_with_other_data_warns_and_the_resume_names_both_fingerprints(copy):
    key = load_config(None, DATA).data.cache_key()
    old = json.loads((copy / "data" / key / "stats.json").read_text())["fingerprint"]
    write_corpus(copy / "corpus" / "a.txt", 120, seed=7)  # the same config, other text
    proc = run_cli("prepare", *DATA, "--force", cwd=copy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = json.loads((copy / "data" / key / "stats.json").read_text())["fingerprint"]
    assert new != old
    assert f"warning: rebuilt data/{key} with other data (fingerprint {old} -> {new})" in proc.stdout
    assert "train.allow_data_change=true" in proc.stdout
    before = snapshot(copy / "run", copy / "data")
    line = one_line(run_cli("train", *TRAIN, "train.resume=latest", "train.max_steps=3", cwd=copy))
    assert f"fingerprint {old}, but data/{key} now holds {new}" in line
    assert "train.allow_data_change=true" in line
    assert snapshot(copy / "run", copy / "data") == before


def test_a_changed_byte_in_a_prepared_arrow_file_is_one_line_naming_it_before_any_step(copy):
    key = load_config(None, DATA).data.cache_key()
    arrow = copy / "data" / key / "dataset" / "train" / "data-00000-of-00001.arrow"
    raw = bytearray(arrow.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    arrow.write_bytes(bytes(raw))
    before = snapshot(copy / "run", copy / "data")
    line = one_line(run_cli("train", *TRAIN, "train.resume=latest", "train.max_steps=3", cwd=copy))
    assert line.startswith(f"bert-mp train: error: the prepared data data/{key} failed its check: ")
    assert "dataset/train/data-00000-of-00001.arrow does not match its checksum" in line
    assert "bert-mp prepare --force" in line
    after = snapshot(copy / "run", copy / "data")
    for snap in (before, after):  # the run folder's own time: its lock was taken, then let go
        snap.pop(str(copy / "run"))
    assert after == before  # nothing written: no step, no checkpoint, no log


def test_resume_with_another_model_shape_is_refused_untouched(project):
    before = snapshot(project / "run", project / "data")
    line = one_line(run_cli("train", *TRAIN, "train.resume=latest", "model.preset=mini", cwd=project))
    assert "train.resume: the run in run was trained with other weights or data (" in line
    assert "model.preset: 'tiny' -> 'mini'" in line
    assert snapshot(project / "run", project / "data") == before


# --------------------------------------------------------------------------------------------------
# config mistakes: one line naming the key, nothing created
# --------------------------------------------------------------------------------------------------
def _absent_tracker() -> str | None:
    for name in ("wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive"):
        if importlib.util.find_spec(name) is None:
            return name
    return None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.log_with=[tensorbord]", "train.log_with[0]: unknown tracker; choose from "),
        ("train.log_with=[ABSENT]", "train.log_with[0]: tracker 'ABSENT' is not installed; pip install "),
        ("data.paths=corpus/a.txt", "data.paths: expects a list, e.g. data.paths=[corpus/a.txt]"),
    ],
    ids=["misspelt-tracker", "tracker-not-installed", "paths-without-brackets"],
)
def test_config_mistakes_are_one_line_naming_the_key(tmp_path, override, expected):
    if "ABSENT" in override:
        absent = _absent_tracker()
        if absent is None:
            pytest.skip("every tracker accelerate knows is installed")
        override, expected = override.replace("ABSENT", absent), expected.replace("ABSENT", absent)
    line = one_line(run_cli("train", override, "train.output_dir=run", "data.cache_dir=data", cwd=tmp_path))
    assert line.startswith(f"bert-mp train: error: {expected}"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("launch", [False, True], ids=["train", "launch"])
def test_train_with_a_missing_corpus_path_is_one_line_before_the_start_up_line(tmp_path, launch):
    """As `bert-mp prepare` says it: no start-up line, no accelerator, no process started."""
    head = ["launch", "--num_processes", "2", "train"] if launch else ["train"]
    bad = ["data.source=text", "data.paths=[corpus/nope*.txt]", "train.output_dir=run", "data.cache_dir=data"]
    proc = run_cli(*head, *bad, cwd=tmp_path)
    line = one_line(proc)
    speaker = "bert-mp launch" if launch else "bert-mp train"
    assert line == f"{speaker}: error: data.paths: no file matches 'corpus/nope*.txt'", line
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_section_given_a_value_in_yaml_is_one_line(tmp_path):
    (tmp_path / "recipe.yaml").write_text("model: tiny\n")
    line = one_line(
        run_cli("train", "recipe.yaml", "train.output_dir=run", "data.cache_dir=data", cwd=tmp_path)
    )
    assert line.startswith("bert-mp train: error: model: is a section, not a value"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


# --------------------------------------------------------------------------------------------------
# fine-tuning input and mistyped local paths
# --------------------------------------------------------------------------------------------------
def finetune(project: Path, tmp_path: Path, csv: str, *extra: str) -> subprocess.CompletedProcess:
    """``bert-mp finetune`` of the project's export on a CSV with ``csv`` as its content; what it
    writes goes to ``tmp_path``."""
    (tmp_path / "train.csv").write_text(csv)
    args = [
        "finetune.checkpoint=run/final",
        "finetune.task=local",
        f"finetune.train_file={tmp_path / 'train.csv'}",
        f"finetune.output_dir={tmp_path / 'ft'}",
        "finetune.max_seq_length=32",
    ]
    return run_cli("finetune", *args, *extra, cwd=project)


@pytest.mark.parametrize(
    ("content", "expected"),
    [("", "is empty (0 bytes)"), ("text,label\n", "has no data rows (a header at most)")],
    ids=["zero-byte", "header-only"],
)
def test_finetune_on_an_empty_csv_is_one_line(project, tmp_path, content, expected):
    line = one_line(finetune(project, tmp_path, content))
    assert line == f"bert-mp finetune: error: finetune.train_file: {tmp_path / 'train.csv'} {expected}"
    assert not (tmp_path / "ft").exists()


def test_finetune_precision_the_cpu_lacks_names_the_finetune_key(project, tmp_path, monkeypatch):
    monkeypatch.setenv("BERT_MP_CPU_MASK", "all")  # as on an AVX2-only CPU
    line = one_line(
        finetune(project, tmp_path, "text,label\nw1 w2 w3,a\nw4 w5,b\n", "finetune.precision=fp16")
    )
    assert line.startswith("bert-mp finetune: error: finetune.precision=fp16 on CPU"), line
    assert "train.precision" not in line and "hardware.allow_emulated=true" in line
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["finetune", "finetune.checkpoint=runs/trian", "finetune.train_file=x.csv"],
            "finetune.checkpoint: no such folder: runs/trian",
        ),
        (["train", "model.init_from=runs/trian"], "model.init_from=runs/trian: no such folder"),
    ],
    ids=["finetune.checkpoint", "model.init_from"],
)
def test_a_mistyped_local_path_fails_at_once_without_the_hub(tmp_path, args, expected):
    """Online (HF_HUB_OFFLINE unset): the path is refused before anything could ask the Hub."""
    (tmp_path / "runs").mkdir()
    t0 = time.monotonic()
    proc = start(
        [*args, "data.cache_dir=data"],
        tmp_path,
        HF_HUB_OFFLINE=None,
        HF_DATASETS_OFFLINE=None,
        TRANSFORMERS_OFFLINE=None,
    )
    out, err = proc.communicate(timeout=120)
    line = one_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert line.endswith(expected), line
    assert time.monotonic() - t0 < 60  # Hub retries would take minutes
    assert [p.name for p in tmp_path.rglob("*")] == ["runs"]


HUB_LIKE = [
    (
        ["finetune", "finetune.checkpoint=runs/nonexistent", "finetune.train_file=x.csv"],
        "finetune.checkpoint",
    ),
    (["finetune", "finetune.checkpoint=.", "finetune.tokenizer=org/no-tokenizer"], "finetune.tokenizer"),
    (["train", "model.init_from=runs/nonexistent"], "model.init_from"),
    (["predict", "runs/nonexistent", "x.csv"], "predict MODEL"),
]


@pytest.mark.parametrize(("args", "key"), HUB_LIKE, ids=[a[1].split("=")[0] for a, _ in HUB_LIKE])
@pytest.mark.parametrize("offline", [True, False], ids=["offline", "hub-unreachable"])
def test_a_name_that_could_be_on_the_hub_is_asked_once_then_one_line(tmp_path, args, key, offline):
    """``runs/nonexistent`` with no runs/ folder here reads as a Hub name: offline, the cache is looked in
    and nothing is asked; online, one request, no retries (each retry would print a warning line) -
    here to a port nothing listens on, so no network is needed."""
    import socket

    with socket.socket() as s:  # a free port, closed again: connections to it are refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HF_HUB_OFFLINE": "1"} if offline else {"HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None}
    if "finetune.checkpoint=." in args:  # a real checkpoint, so the tokenizer is what is asked about
        args = [
            a.replace("finetune.checkpoint=.", f"finetune.checkpoint={_tiny_bert(tmp_path)}") for a in args
        ]
    proc = start(
        [*args, "data.cache_dir=data"] if args[0] != "predict" else args,
        tmp_path,
        HF_ENDPOINT=f"http://127.0.0.1:{port}",
        HF_HUB_CACHE=str(tmp_path / "hub-cache"),
        **env,
    )
    out, err = proc.communicate(timeout=120)
    line = one_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    why = "(HF_HUB_OFFLINE=1: the Hub is not asked)" if offline else "the Hub cannot be reached"
    assert line.startswith(f"bert-mp {args[0]}: error: {key}: ") and why in line, line
    assert "neither a local folder nor in the Hub cache" in line


def _tiny_bert(root: Path) -> Path:
    from transformers import BertConfig, BertForPreTraining

    folder = root / "bert"
    cfg = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    BertForPreTraining(cfg).save_pretrained(folder)
    make_tokenizer().save_pretrained(str(folder))
    return folder


def test_a_training_checkpoint_as_finetune_checkpoint_points_at_final_or_export(project, tmp_path):
    """checkpoints/step_N is resumable state, not a model folder: the error names the run's final/, or
    (a run without one) the bert-mp export command and the folder it writes."""
    step = project / "run" / "checkpoints" / "step_00000002"
    assert step.is_dir()
    line = one_line(
        run_cli("finetune", f"finetune.checkpoint={step}", "finetune.train_file=x.csv", cwd=tmp_path)
    )
    assert line.endswith(
        f"it is a training checkpoint: use the run's export {project / 'run' / 'final'}, or "
        f"`bert-mp export {step}` writes this step as {project / 'run' / 'export-step_00000002'}"
    ), line
    bare = tmp_path / "r" / "checkpoints" / "step_00000007"
    bare.mkdir(parents=True)
    (bare / "loop_state.json").write_text("{}")
    line = one_line(
        run_cli("finetune", f"finetune.checkpoint={bare}", "finetune.train_file=x.csv", cwd=tmp_path)
    )
    assert line.endswith(
        f"it is a training checkpoint: `bert-mp export {bare}` writes this step as "
        f"{tmp_path / 'r' / 'export-step_00000007'}; use that folder"
    ), line
