"""Downstream task data: built-in split without leakage, local files, Hub / GLUE path, labels."""

import json
import random
from collections import Counter, defaultdict

import datasets
import pytest

from bert_mp.core.config import FinetuneConfig
from bert_mp.data.builtin_corpus import iter_stdlib_docstrings
from bert_mp.errors import ConfigError, DataError
from bert_mp.finetune import tasks
from bert_mp.finetune.tasks import (
    SPLITS,
    assign_modules,
    build_label_space,
    builtin_kind_rows,
    builtin_package_rows,
    encode_labels,
    load_task,
)


@pytest.fixture(scope="module")
def docstrings():
    return list(iter_stdlib_docstrings())


def _norm(text):
    return " ".join(text.split()).lower()


# --------------------------------------------------------------------------------------------------
# split assignment
# --------------------------------------------------------------------------------------------------
def test_assign_modules_covers_every_split_and_ignores_input_order():
    sizes = {f"m{i}": n for i, n in enumerate([500, 3, 40, 41, 7, 90, 12, 13, 60, 2])}
    a = assign_modules(sizes)
    b = assign_modules(dict(reversed(list(sizes.items()))))
    assert a == b
    assert set(a) == set(sizes)
    assert set(a.values()) == set(SPLITS)


def test_assign_modules_balances_by_examples():
    rng = random.Random(0)
    sizes = {f"mod{i}": rng.randint(1, 30) for i in range(300)}
    split = assign_modules(sizes)
    total = sum(sizes.values())
    for name, frac in tasks.BUILTIN_FRACTIONS.items():
        share = sum(n for m, n in sizes.items() if split[m] == name) / total
        assert abs(share - frac) < 0.02, (name, share)


def test_assign_modules_with_fewer_modules_than_splits():
    assert set(assign_modules({"a": 5, "b": 3}).values()) <= set(SPLITS)


# --------------------------------------------------------------------------------------------------
# built-in tasks on the real corpus: no leakage
# --------------------------------------------------------------------------------------------------
def _assert_no_leakage(by_split):
    module_splits = defaultdict(set)
    text_splits = defaultdict(set)
    for split, rows in by_split.items():
        for r in rows:
            module_splits[r["module"]].add(split)
            text_splits[_norm(r["text"])].add(split)
    leaked_modules = [m for m, s in module_splits.items() if len(s) > 1]
    leaked_texts = [t for t, s in text_splits.items() if len(s) > 1]
    assert leaked_modules == [] and leaked_texts == []


def test_builtin_package_task_split_by_module_without_leakage(docstrings):
    by_split, stats = builtin_package_rows(docstrings, min_modules=4, min_examples=100, min_words=3)
    _assert_no_leakage(by_split)
    classes = stats["classes"]
    assert len(classes) >= 5
    for split in SPLITS:
        assert {r["label"] for r in by_split[split]} == set(classes), split
    # The label is real metadata: the top-level package of the docstring's module.
    for rows in by_split.values():
        assert all(r["module"].split(".")[0] == r["label"] for r in rows)
        assert all(len(r["text"].split()) >= 3 for r in rows)
    modules = defaultdict(set)
    for rows in by_split.values():
        for r in rows:
            modules[r["label"]].add(r["module"])
    assert all(len(modules[c]) >= 4 for c in classes)
    sizes = {s: len(by_split[s]) for s in SPLITS}
    assert sizes["train"] > sizes["validation"] > 0 and sizes["test"] > 0


def test_builtin_split_is_fixed_whatever_the_input_order(docstrings):
    a, _ = builtin_package_rows(docstrings)
    b, _ = builtin_package_rows(list(reversed(docstrings)))
    for split in SPLITS:
        assert Counter((r["module"], r["text"]) for r in a[split]) == Counter(
            (r["module"], r["text"]) for r in b[split]
        )


def test_builtin_kind_task_without_leakage(docstrings):
    by_split, stats = builtin_kind_rows(docstrings, min_words=3)
    _assert_no_leakage(by_split)
    assert stats["classes"] == ["class", "function", "module"]
    for split in SPLITS:
        assert {r["label"] for r in by_split[split]} == {"class", "function", "module"}


def test_too_strict_class_rule_is_a_clear_error(docstrings):
    with pytest.raises(DataError, match="builtin_min_modules"):
        builtin_package_rows(docstrings, min_modules=10_000)


def test_load_task_builtin_on_a_small_stdlib_tree(tmp_path):
    for pkg in ("alpha", "beta"):
        (tmp_path / pkg).mkdir()
        for i in range(4):
            body = "\n".join(
                f'def f{j}():\n    """{pkg} function number {j} of module {i} does work."""\n'
                for j in range(5)
            )
            (tmp_path / pkg / f"mod{i}.py").write_text(f'"""The {pkg} module {i} docs here."""\n' + body)
    cfg = FinetuneConfig(task="builtin-package", builtin_min_modules=4, builtin_min_examples=10)
    td = load_task(cfg, builtin_root=tmp_path)
    assert set(td.splits) == set(SPLITS) and not td.has_pair
    assert set(td.splits["train"]["label"]) == {"alpha", "beta"}
    assert sum(len(td.splits[s]) for s in SPLITS) == 2 * 4 * 6


# --------------------------------------------------------------------------------------------------
# local files
# --------------------------------------------------------------------------------------------------
def _write(path, rows):
    ds = datasets.Dataset.from_list(rows)
    suffix = path.suffix
    if suffix == ".csv":
        ds.to_csv(str(path), index=False)
    elif suffix == ".jsonl":
        ds.to_json(str(path), lines=True)
    else:
        ds.to_parquet(str(path))
    return str(path)


ROWS = [
    {"sentence": f"text number {i}", "other": f"pair {i}", "y": "pos" if i % 2 else "neg"} for i in range(20)
]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_local_formats_with_string_labels_and_pairs(tmp_path, suffix):
    train = _write(tmp_path / f"train{suffix}", ROWS)
    val = _write(tmp_path / f"val{suffix}", ROWS[:6])
    cfg = FinetuneConfig(
        task="local",
        train_file=train,
        validation_file=val,
        text_column="sentence",
        text_pair_column="other",
        label_column="y",
    )
    td = load_task(cfg)
    assert td.has_pair and set(td.splits) == {"train", "validation"}
    assert set(td.splits["train"].column_names) == {"text", "text_pair", "label"}
    assert td.splits["train"][3] == {"text": "text number 3", "text_pair": "pair 3", "label": "pos"}


def test_local_integer_labels_and_held_out_validation(tmp_path):
    rows = [{"text": f"t {i}", "label": i % 3} for i in range(50)]
    cfg = FinetuneConfig(task="local", train_file=_write(tmp_path / "t.csv", rows), validation_fraction=0.2)
    td = load_task(cfg)
    assert len(td.splits["validation"]) == 10 and len(td.splits["train"]) == 40
    assert set(td.splits["train"]["text"]).isdisjoint(td.splits["validation"]["text"])
    again = load_task(cfg)
    assert again.splits["validation"]["text"] == td.splits["validation"]["text"]
    space = build_label_space(td.splits["train"]["label"])
    assert space.values == [0, 1, 2] and space.names == ["0", "1", "2"]


def test_rows_without_text_or_label_are_dropped_and_counted(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("text,label\nhello,a\n,b\nworld,\nagain,a\nmore,b\n")
    td = load_task(FinetuneConfig(task="local", train_file=str(p), validation_file=str(p)))
    assert len(td.splits["train"]) == 3
    assert td.stats["rows_without_text_or_label_dropped"] == {"train": 2, "validation": 2}


def test_missing_column_names_it(tmp_path):
    train = _write(tmp_path / "t.csv", ROWS)
    with pytest.raises(DataError, match="'text'.*finetune.text_column"):
        load_task(FinetuneConfig(task="local", train_file=train, label_column="y"))


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(ConfigError, match="finetune.train_file: file not found"):
        load_task(FinetuneConfig(task="local", train_file=str(tmp_path / "nope.csv")))
    bad = tmp_path / "data.xlsx"
    bad.write_text("x")
    with pytest.raises(ConfigError, match="unknown extension"):
        load_task(FinetuneConfig(task="local", train_file=str(bad)))


# --------------------------------------------------------------------------------------------------
# the Hub path (with local data: no network here)
# --------------------------------------------------------------------------------------------------
def test_hub_path_with_a_local_dataset_folder(tmp_path):
    _write(tmp_path / "train.csv", ROWS)
    _write(tmp_path / "validation.csv", ROWS[:4])
    _write(tmp_path / "test.csv", ROWS[4:8])
    cfg = FinetuneConfig(
        task="hub", hub_name=str(tmp_path), test_split="test", text_column="sentence", label_column="y"
    )
    td = load_task(cfg)
    assert {s: len(d) for s, d in td.splits.items()} == {"train": 20, "validation": 4, "test": 4}


def test_hub_split_missing_is_clear(tmp_path):
    _write(tmp_path / "train.csv", ROWS)
    cfg = FinetuneConfig(task="hub", hub_name=str(tmp_path), text_column="sentence", label_column="y")
    with pytest.raises(DataError, match="no split 'validation'"):
        load_task(cfg)


def test_glue_task_reads_the_hubs_parquet_files_with_hidden_test_labels(monkeypatch):
    """Without finetune.glue_data the task reads nyu-mll/glue's own files from the Hub: the boundary is
    the one datasets call a local copy goes through too."""
    calls = []
    features = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]),
            "idx": datasets.Value("int32"),
        }
    )

    def fake_load_dataset(path, data_files=None):
        calls.append((path, data_files))
        rows = [{"sentence1": f"a {i}", "sentence2": f"b {i}", "label": i % 2, "idx": i} for i in range(10)]
        hidden = [dict(r, label=-1) for r in rows]
        by_split = {"train": rows, "validation": rows[:4] + hidden[:2]}
        return datasets.DatasetDict(
            {s: datasets.Dataset.from_list(by_split[s], features=features) for s in data_files}
        )

    monkeypatch.setattr(tasks.datasets, "load_dataset", fake_load_dataset)
    td = load_task(FinetuneConfig(task="glue/mrpc"))
    hub = "hf://datasets/nyu-mll/glue/mrpc"
    assert calls == [
        (
            "parquet",
            {
                "train": f"{hub}/train-00000-of-00001.parquet",
                "validation": f"{hub}/validation-00000-of-00001.parquet",
            },
        )
    ]
    assert td.has_pair and set(td.splits) == {"train", "validation"} and not td.regression
    assert td.stats["label_names"] == ["not_equivalent", "equivalent"]
    assert td.stats["rows_without_text_or_label_dropped"] == {"train": 0, "validation": 2}
    space = build_label_space(td.splits["train"]["label"], td.stats["label_names"])
    assert space.id2label() == {0: "not_equivalent", 1: "equivalent"}


def test_unknown_glue_task_and_offline_hub_are_clear(monkeypatch):
    with pytest.raises(ConfigError, match="unknown GLUE task 'sts'; choose from cola, sst2"):
        load_task(FinetuneConfig(task="glue/sts"))

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(tasks.datasets, "load_dataset", offline)
    with pytest.raises(
        DataError, match=r"cannot read GLUE sst2 from the Hub .*no network\? give a local copy"
    ):
        load_task(FinetuneConfig(task="glue/sst2"))


# --------------------------------------------------------------------------------------------------
# labels
# --------------------------------------------------------------------------------------------------
def test_label_space_sorts_and_rejects_regression_or_mixed():
    assert build_label_space(["b", "a", "b"]).names == ["a", "b"]
    assert build_label_space([10, 2, 2.0]).values == [2, 10]
    with pytest.raises(DataError, match="regression"):
        build_label_space([0.5, 1.0])
    with pytest.raises(DataError, match="mixes"):
        build_label_space(["a", 1])
    with pytest.raises(DataError, match="at least 2"):
        build_label_space(["a", "a"])


def test_unseen_labels_counted_or_refused():
    space = build_label_space(["neg", "pos"])
    ids, unseen = encode_labels(["pos", "neutral", "neg", "neutral", "other"], space, "validation")
    assert ids == [1, 2, 0, 2, 3]
    assert unseen == {"neutral": 2, "other": 1}
    with pytest.raises(DataError, match="validation has labels never seen in train: 'neutral' x2"):
        encode_labels(["pos", "neutral", "neutral"], space, "validation", policy="error")


@pytest.mark.parametrize(
    "content,message", [("", "is empty \\(0 bytes\\)"), ("text,label\n", "has no data rows")]
)
def test_empty_and_header_only_files_are_one_line(tmp_path, content, message):
    from bert_mp.core.config import FinetuneConfig
    from bert_mp.errors import DataError
    from bert_mp.finetune.tasks import load_local

    path = tmp_path / "train.csv"
    path.write_text(content)
    with pytest.raises(DataError, match=f"^finetune\\.train_file: {path} {message}") as e:
        load_local(FinetuneConfig(task="local", train_file=str(path)))
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------
# the row and label rules fine-tuning and predict share
# --------------------------------------------------------------------------------------------------
def test_labels_are_normalised_once_whatever_type_the_reader_chose():
    from bert_mp.finetune.tasks import normalize_label

    # the same CSV cell read as int, float (a blank elsewhere in the column) or text (a word elsewhere)
    assert (
        normalize_label(10)
        == normalize_label(10.0)
        == normalize_label("10")
        == normalize_label(" 10.0 ")
        == 10
    )
    assert normalize_label(True) == 1 and normalize_label("-2") == -2
    assert normalize_label("travel") == "travel" and normalize_label("1.5") == "1.5"  # text stays text
    for missing in (None, float("nan"), "", "   "):
        assert normalize_label(missing) is None
    with pytest.raises(DataError, match="regression"):
        normalize_label(0.5)
    with pytest.raises(DataError, match="not a class"):
        normalize_label([1])


def test_row_rules():
    from bert_mp.finetune.tasks import row_problem

    assert row_problem("a text", None, "pos", has_pair=False, class_ids=False) is None
    assert row_problem("", None, "pos", has_pair=False, class_ids=False) == "text"
    assert row_problem("  ", None, "pos", has_pair=False, class_ids=False) == "text"
    assert row_problem(None, None, "pos", has_pair=False, class_ids=False) == "text"
    assert row_problem("a", None, "pos", has_pair=True, class_ids=False) == "text_pair"
    assert row_problem("a", " ", "pos", has_pair=True, class_ids=False) == "text_pair"
    assert row_problem("a", "b", float("nan"), has_pair=True, class_ids=False) == "label"
    assert row_problem("a", None, -1, has_pair=False, class_ids=True) == "label"  # a hidden ClassLabel
    assert row_problem("a", None, -1, has_pair=False, class_ids=False) is None  # -1 is a class of its own


def test_a_text_label_in_an_integer_space_is_unseen_by_its_name():
    space = build_label_space([3, 10, 3.0])
    ids, unseen = encode_labels(["3", 10.0, "travel", "10", "travel", "other"], space, "test")
    assert ids == [0, 1, 2, 1, 2, 3] and unseen == {"travel": 2, "other": 1}
    assert space.metric_names(unseen) == {0: "3", 1: "10", 2: "unseen:travel", 3: "unseen:other"}
    named = build_label_space([0, 1], ["neg", "pos"])  # a ClassLabel: a file may give the names
    assert encode_labels(["pos", 0, "1"], named, "test") == ([1, 0, 1], {})


def test_task_record_round_trip_and_strict_read(tmp_path):
    from bert_mp.finetune.tasks import TASK_RECORD, TaskRecord

    rec = TaskRecord("local", "review", None, "license", 64, [3, 10], ["3", "10"], False)
    rec.write(tmp_path)
    assert TaskRecord.read(tmp_path) == rec and rec.label_space().values == [3, 10]
    assert TaskRecord.read(tmp_path / "nowhere") is None
    d = json.loads((tmp_path / TASK_RECORD).read_text())
    del d["max_seq_length"]
    (tmp_path / TASK_RECORD).write_text(json.dumps({**d, "extra": 1}))
    with pytest.raises(DataError, match="missing max_seq_length, unknown extra"):
        TaskRecord.read(tmp_path)
