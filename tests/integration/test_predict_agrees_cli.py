"""``bert-mp predict`` agrees with ``bert-mp finetune`` on fine-tuning's own test file, through the real
CLI: the same truncation, row rules and label normalisation give the same metrics as summary.json;
predict reads the fine-tune's own columns by default; a stopped fine-tune exits like ``bert-mp train``.
Predict runs in a fresh process; the fine-tunes it is compared with run through the same CLI entry
point (``bert_mp.cli.main``) in the test's process, except the stopped one."""

import csv
import json
import signal
import subprocess
import sys

import forkserver
import pytest
from support import FINETUNE_WORDS, hold_env, run_cli, sentence, wait_held

MAX_LEN = 16  # the fine-tuning length; the checkpoint has 64 positions
COMPARED = ("accuracy", "macro_f1", "mcc", "per_class_f1", "examples")


def _write(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def _long(i, word):
    """A row that reads as ``word``'s up to token MAX_LEN and then names the other label: fine-tuning
    and predict cut it before the second word; a reader of all of it sees both."""
    other = "stone" if word == "apple" else "apple"
    filler = [w for w in FINETUNE_WORDS if w not in ("apple", "stone")]
    tail = [filler[(i + j) % len(filler)] for j in range(12)]
    return " ".join([sentence(i, word), *tail, other, other, other])


LABEL_OF = {"apple": 3, "stone": 10}  # integer labels


def _train_rows(n, offset=0):
    return [
        [sentence(i, w), LABEL_OF[w]] for i in range(offset, offset + n) for w in [("apple", "stone")[i % 2]]
    ]


def _finetune(tmp_path, ckpt, test_file, *extra):
    """``bert-mp finetune`` on review/license columns; returns summary.json."""
    out = tmp_path / "ft"
    args = [
        f"finetune.checkpoint={ckpt}",
        "finetune.task=local",
        f"finetune.train_file={_write(tmp_path / 'train.csv', ['review', 'license'], _train_rows(96))}",
        f"finetune.validation_file={_write(tmp_path / 'val.csv', ['review', 'license'], _train_rows(24, 500))}",
        f"finetune.test_file={test_file}",
        "finetune.text_column=review",
        "finetune.label_column=license",
        f"finetune.output_dir={out}",
        "finetune.batch_size=16",
        "finetune.learning_rate=3e-3",
        "finetune.warmup_ratio=0.0",
        "finetune.epochs=4",
        f"finetune.max_seq_length={MAX_LEN}",
        "finetune.progress_bar=false",
        *extra,
    ]
    _finetune_here(args)
    return json.loads((out / "summary.json").read_text())


def _finetune_here(args: list[str]) -> None:
    """``bert-mp finetune ARGS`` through the CLI's entry point, in this process (paths are absolute)."""
    from bert_mp.cli import main

    assert main(["finetune", *args]) == 0


def _predict(tmp_path, model, file, *flags, name="p", code=0):
    """``bert-mp predict`` (no column flags unless given); returns (metrics.json, predictions, stdout)."""
    out = tmp_path / name
    proc = run_cli("predict", str(model), file, "--out", str(out), *flags, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr[-3000:]
    if code:
        return None, None, proc.stderr
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return json.loads((out / "metrics.json").read_text()), rows, proc.stdout


# --------------------------------------------------------------------------------------------------
# one fine-tune whose test file has long rows, rows with holes, and integer labels read as floats
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def holes(tmp_path_factory, ckpt):
    """The test file: 12 short rows, 8 long ones (cut at MAX_LEN), 2 without text, 3 without a label -
    a blank in the integer column makes pandas read it as floats (3.0, 10.0)."""
    tmp = tmp_path_factory.mktemp("holes")
    rows = [[sentence(i, w), LABEL_OF[w]] for i in range(900, 912) for w in [("apple", "stone")[i % 2]]]
    rows += [[_long(i, w), LABEL_OF[w]] for i in range(8) for w in [("apple", "stone")[i % 2]]]
    rows += [["", 3], ["   ", 10]]
    rows += [[sentence(i, "apple"), ""] for i in range(950, 953)]
    test = _write(tmp / "test.csv", ["review", "license"], rows)
    summary = _finetune(tmp, ckpt, test)
    metrics, preds, stdout = _predict(tmp, tmp / "ft", test)
    return {
        "tmp": tmp,
        "test": test,
        "summary": summary,
        "metrics": metrics,
        "preds": preds,
        "stdout": stdout,
    }


def test_predict_reads_the_finetunes_own_columns_and_reports_its_metrics(holes):
    """No column flags: predict reads review/license (recorded in final/) and scores the file."""
    s, m = holes["summary"], holes["metrics"]
    assert m["columns"] == {"text": "review", "text_pair": None, "label": "license"}
    assert {k: m["metrics"][k] for k in COMPARED} == {k: s["test"][k] for k in COMPARED}
    assert "accuracy" in holes["stdout"] and "macro-F1" in holes["stdout"]


def test_same_truncation_as_finetuning(holes):
    s, m, preds = holes["summary"], holes["metrics"], holes["preds"]
    assert m["max_seq_length"] == s["task"]["max_seq_length"] == MAX_LEN
    assert m["truncated_scored"] == s["task"]["truncated"]["test"] == 8  # the long rows, counted alike
    assert m["truncated"] == 8
    assert f"(8 truncated at {MAX_LEN} tokens)" in holes["stdout"]
    assert {k: m["metrics"][k] for k in COMPARED} == {k: s["test"][k] for k in COMPARED}
    # pipeline(truncation=True) on final/ cuts where fine-tuning cut: the same labels as predict
    from transformers import pipeline

    clf = pipeline("text-classification", model=str(holes["tmp"] / "ft" / "final"), truncation=True)
    long_rows = [_long(i, w) for i in range(8) for w in [("apple", "stone")[i % 2]]]
    assert [r["label"] for r in clf(long_rows)] == [p["label"] for p in preds[12:20]]
    # --max-seq-length overrides: nothing is cut at the model's 64 positions, and the long rows'
    # deciding word is seen again
    wide, wide_preds, _ = _predict(
        holes["tmp"], holes["tmp"] / "ft", holes["test"], "--max-seq-length", "64", name="w"
    )
    assert wide["max_seq_length"] == 64 and wide["truncated"] == 0
    assert wide_preds[:12] == preds[:12] and wide_preds[12:20] != preds[12:20]


def test_rows_with_holes_are_predicted_but_not_scored(holes):
    s, m, preds = holes["summary"], holes["metrics"], holes["preds"]
    assert s["task"]["rows_without_text_or_label_dropped"]["test"] == 5
    assert m["rows_without_text_or_label"] == 5 and m["rows"] == 25 and len(preds) == 25
    assert m["metrics"]["examples"] == s["test"]["examples"] == 20
    assert [p["gold"] for p in preds[20:]] == [3, 10, None, None, None]  # every row keeps a prediction
    assert set(m["metrics"]["per_class_f1"]) == {"3", "10"}  # no "None" class
    assert {k: m["metrics"][k] for k in COMPARED} == {k: s["test"][k] for k in COMPARED}
    assert "5 without text or label" in holes["stdout"]


def test_integer_labels_read_as_floats_match_the_trained_labels(holes):
    s, m, preds = holes["summary"], holes["metrics"], holes["preds"]
    assert s["task"]["labels"] == ["3", "10"]
    assert [p["gold"] for p in preds[:2]] == [3, 10]  # 3.0 / 10.0 in the file as pandas reads it
    assert m["unseen_labels"] == {} and s["task"]["unseen_labels"] == {}
    assert m["metrics"]["accuracy"] == s["test"]["accuracy"] > 0.5


# --------------------------------------------------------------------------------------------------
# a test file that mixes a text label into the integer label space
# --------------------------------------------------------------------------------------------------
def test_a_text_label_among_integers_is_scored_on_the_shared_labels(tmp_path, ckpt):
    rows = [[sentence(i, w), LABEL_OF[w]] for i in range(900, 916) for w in [("apple", "stone")[i % 2]]]
    rows += [[sentence(i, "apple"), "travel"] for i in range(960, 964)]
    test = _write(tmp_path / "test.csv", ["review", "license"], rows)  # a string column: "3", "10", "travel"
    s = _finetune(tmp_path, ckpt, test)
    m, preds, _ = _predict(tmp_path, tmp_path / "ft", test)
    assert s["task"]["unseen_labels"] == {"test": {"travel": 4}} and m["unseen_labels"] == {"travel": 4}
    assert "unseen:travel" in s["test"]["per_class_f1"] and "unseen:travel" in m["metrics"]["per_class_f1"]
    assert [p["gold"] for p in preds[:2]] == [3, 10]
    assert {k: m["metrics"][k] for k in COMPARED} == {k: s["test"][k] for k in COMPARED}
    assert s["test"]["accuracy"] >= 0.5  # "3" and "10" are the trained 3 and 10: scored, mostly right


def test_a_pair_task_is_read_with_its_own_pair_column(tmp_path, ckpt):
    """Fine-tuned on question/answer/verdict columns: predict reads all three without flags, and a row
    whose second text is blank is predicted but not scored, as fine-tuning dropped it."""
    filler = [w for w in FINETUNE_WORDS if w not in ("apple", "stone")]

    def rows(n, offset):
        return [
            [" ".join(filler[(i + j) % len(filler)] for j in range(3)), sentence(i, w), w]
            for i in range(offset, offset + n)
            for w in [("apple", "stone")[i % 2]]
        ]

    header = ["question", "answer", "verdict"]
    test = _write(tmp_path / "test.csv", header, [*rows(16, 900), ["seven quiet", "", "apple"]])
    args = [
        f"finetune.checkpoint={ckpt}",
        "finetune.task=local",
        f"finetune.train_file={_write(tmp_path / 'train.csv', header, rows(96, 0))}",
        f"finetune.validation_file={_write(tmp_path / 'val.csv', header, rows(24, 500))}",
        f"finetune.test_file={test}",
        "finetune.text_column=question",
        "finetune.text_pair_column=answer",
        "finetune.label_column=verdict",
        f"finetune.output_dir={tmp_path / 'ft'}",
        "finetune.batch_size=16",
        "finetune.learning_rate=3e-3",
        "finetune.warmup_ratio=0.0",
        "finetune.epochs=4",
        f"finetune.max_seq_length={MAX_LEN}",
        "finetune.progress_bar=false",
    ]
    _finetune_here(args)
    s = json.loads((tmp_path / "ft" / "summary.json").read_text())
    m, preds, _ = _predict(tmp_path, tmp_path / "ft", test)
    assert m["columns"] == {"text": "question", "text_pair": "answer", "label": "verdict"}
    assert s["task"]["rows_without_text_or_label_dropped"]["test"] == m["rows_without_text_or_label"] == 1
    assert len(preds) == 17 and m["metrics"]["examples"] == 16
    assert {k: m["metrics"][k] for k in COMPARED} == {k: s["test"][k] for k in COMPARED}
    assert s["test"]["accuracy"] >= 0.75  # the deciding word is in the second text: the pair was read


# --------------------------------------------------------------------------------------------------
# column mistakes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--text-column", "--text-pair-column", "--label-column"])
def test_a_wrong_column_flag_names_the_column_and_lists_the_columns(holes, flag):
    _, _, err = _predict(holes["tmp"], holes["tmp"] / "ft", holes["test"], flag, "nope", code=2)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        f"bert-mp predict: error: {holes['test']} has no column 'nope' (columns: review, license); set {flag}"
    ]


def test_a_file_without_the_label_column_gets_predictions_only(holes):
    file = _write(
        holes["tmp"] / "unlabelled.csv", ["review"], [[sentence(1, "apple")], [sentence(2, "stone")]]
    )
    m, preds, stdout = _predict(holes["tmp"], holes["tmp"] / "ft", file, name="u")
    assert "metrics" not in m and m["no_label_column"] == "license" and len(preds) == 2
    assert "no metrics (the file has no 'license' column)" in stdout


# --------------------------------------------------------------------------------------------------
# a stopped fine-tune exits like bert-mp train
# --------------------------------------------------------------------------------------------------
@pytest.mark.signals
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["TERM", "INT"])
def test_a_stopped_finetune_exits_like_train(tmp_path, ckpt, sig, code):
    """The run has 100,000 steps to go when the signal lands (it holds after step 1 until it does)."""
    import os

    train = _write(tmp_path / "train.csv", ["text", "label"], _train_rows(64))
    out = tmp_path / "ft"
    ready = tmp_path / "held"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(hold_env("step:1", ready))
    args = [f"finetune.checkpoint={ckpt}", "finetune.task=local", f"finetune.train_file={train}"]
    args += [f"finetune.output_dir={out}", "finetune.max_steps=100000", "finetune.progress_bar=false"]
    args += ["finetune.batch_size=8", f"finetune.max_seq_length={MAX_LEN}"]
    proc = forkserver.popen(
        [sys.executable, "-m", "bert_mp", "finetune", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    wait_held(proc, ready)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    name = signal.Signals(sig).name
    assert proc.returncode == code, stderr[-3000:]
    assert summary["status"] == "stopped" and summary["stop_reason"] == f"signal {name}"
    assert not (out / "final").exists()
    lines = [line for line in stdout.splitlines() if line.startswith("bert-mp finetune:")]
    assert lines[0].startswith("bert-mp finetune: 1 process x "), lines  # the start-up line
    assert lines[1:] == [
        f"bert-mp finetune: stopped after {summary['steps']} steps (signal {name}; checkpoint saved) -> {out}; "
        "continue it with the same command and finetune.resume=latest"
    ]
    assert (out / "checkpoints" / f"step_{summary['steps']:08d}" / "COMPLETE").is_file()
