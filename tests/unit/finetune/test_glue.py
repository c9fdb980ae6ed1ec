"""``bert-mp glue``: the suite on a tiny local copy in the Hub's layout (per-task table, the average,
STS-B as a regression, MNLI matched and mismatched), its metrics against scikit-learn's and SciPy's,
the Hub path up to its one datasets call, and the mistakes refused before any training (the
interrupted suite resumed: integration/test_glue_cli.py)."""

import json
import random
import shutil

import datasets
import pytest
import torch
from support import glue_checkpoint, write_glue_folder

from bert_mp.cli import main
from bert_mp.core.config import GLUE_SUITE, GLUE_TASK_NAMES
from bert_mp.core.process import conditions
from bert_mp.finetune.glue import average, split_metrics
from bert_mp.finetune.glue_data import GLUE_TASKS, glue_task
from bert_mp.finetune.metrics import classification_metrics, regression_metrics

RECIPE = [
    "finetune.max_seq_length=32",
    "finetune.batch_size=16",
    "finetune.learning_rate=3e-3",
    "finetune.warmup_ratio=0",
    "finetune.epochs=2",
    "finetune.progress_bar=false",
]


@pytest.fixture
def cli(monkeypatch):
    """``bert-mp ...`` in this process; the command's thread choice undone afterwards."""
    monkeypatch.setattr(conditions, "_CHOSEN", [])
    threads = torch.get_num_threads()
    yield main
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue")
    return write_glue_folder(root / "glue"), glue_checkpoint(root / "ckpt")


@pytest.fixture(scope="module")
def suite(glue_dir, tmp_path_factory):
    """The default suite (BERT's eight tasks) fine-tuned once from the tiny checkpoint."""
    data, ckpt = glue_dir
    out = tmp_path_factory.mktemp("suite") / "out"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(conditions, "_CHOSEN", [])
        code = main(["glue", str(ckpt), "--data", str(data), *RECIPE, f"glue.output_dir={out}"])
    torch.set_num_threads(threads)
    assert code == 0
    return out


def test_the_task_names_are_the_config_choices():
    assert tuple(GLUE_TASKS) == GLUE_TASK_NAMES and set(GLUE_SUITE) == set(GLUE_TASK_NAMES) - {"wnli"}


def test_a_local_copy_gives_the_per_task_table_and_the_glue_average(suite):
    data = json.loads((suite / "glue.json").read_text())
    tasks = data["tasks"]
    assert list(tasks) == list(GLUE_SUITE) and all(t["status"] == "completed" for t in tasks.values())
    figures = [v for t in tasks.values() for v in t["scores"].values()]
    assert len(figures) == 9  # MNLI counts twice (matched, mismatched), WNLI not at all
    assert data["complete"] and data["average"] == pytest.approx(sum(figures) / 9)
    assert set(tasks["mnli"]["splits"]) == {"validation_matched", "validation_mismatched"}
    assert set(tasks["mrpc"]["splits"]["validation"]) == {"f1", "accuracy", "examples"}
    assert tasks["cola"]["scores"]["CoLA"] == pytest.approx(
        100 * tasks["cola"]["splits"]["validation"]["mcc"]
    )
    assert tasks["stsb"]["score_metric"] == "spearman"
    table = (suite / "glue.md").read_text()
    for row in ("| CoLA | MCC |", "| MNLI-mm | accuracy |", "| STS-B | Pearson/Spearman |", "GLUE average"):
        assert row in table


def test_stsb_trains_as_a_regression(suite):
    summary = json.loads((suite / "stsb" / "summary.json").read_text())
    assert summary["task"]["regression"] and summary["task"]["num_labels"] == 1
    assert set(summary["validation"]) >= {"pearson", "spearman", "mse", "loss"}
    assert summary["validation"]["loss"] == pytest.approx(summary["validation"]["mse"], rel=1e-5)
    config = json.loads((suite / "stsb" / "final" / "config.json").read_text())
    assert config["problem_type"] == "regression" and len(config["id2label"]) == 1
    rows = [json.loads(x) for x in (suite / "stsb" / "metrics.jsonl").read_text().splitlines()]
    assert "validation/spearman" in next(r for r in rows if r["kind"] == "eval")
    # MNLI's mismatched split is evaluated after training, beside its matched validation
    mnli = [json.loads(x) for x in (suite / "mnli" / "metrics.jsonl").read_text().splitlines()]
    assert any("validation_mismatched/accuracy" in r for r in mnli)


def test_each_metric_is_scikit_learns_or_scipys():
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    rng = random.Random(0)
    for classes in (2, 3):
        y = [rng.randrange(classes) for _ in range(200)]
        p = [t if rng.random() < 0.7 else rng.randrange(classes) for t in y]
        m = classification_metrics(y, p)
        assert m["accuracy"] == accuracy_score(y, p) and m["mcc"] == matthews_corrcoef(y, p)
        assert m["macro_f1"] == pytest.approx(f1_score(y, p, average="macro"))
        names = ["no", "yes", "maybe"][:classes]
        named = {**m, "per_class_f1": {names[c]: v for c, v in m["per_class_f1"].items()}}
        if classes == 2:  # GLUE's F1 (MRPC, QQP): the positive class's, scikit-learn's binary F1
            got = split_metrics(glue_task("mrpc"), named, names)
            assert got["f1"] == pytest.approx(f1_score(y, p)) and got["accuracy"] == accuracy_score(y, p)
    t = [rng.uniform(0, 5) for _ in range(100)]
    s = [v + rng.gauss(0, 1) for v in t]
    r = regression_metrics(t, s)
    assert r["pearson"] == pytest.approx(pearsonr(t, s).statistic)
    assert r["spearman"] == pytest.approx(spearmanr(t, s).statistic)
    # a constant side: undefined for SciPy (NaN), 0 here - as scikit-learn's MCC is for one class
    assert regression_metrics(t, [1.0] * 100)["spearman"] == 0.0


def test_the_average_takes_wnli_out_and_says_what_is_missing():
    tasks = {"cola": {"scores": {"CoLA": 40.0}}, "wnli": {"scores": {"WNLI": 99.0}}}
    avg = average(tasks)
    assert avg["average"] == 40.0 and avg["average_of"] == ["CoLA"] and not avg["complete"]
    assert "MNLI-mm" in avg["missing"] and "WNLI" not in avg["missing"]


def test_without_data_the_suite_reads_the_hubs_files(glue_dir, tmp_path, monkeypatch, cli):
    """No network here: the one call the Hub path makes is answered from the local copy, after
    checking it asked for nyu-mll/glue's own files."""
    data, ckpt = glue_dir
    asked = []
    real = datasets.load_dataset

    def from_local_copy(path, data_files=None, **kw):
        asked.append(data_files)
        local = {s: f.replace("hf://datasets/nyu-mll/glue", str(data)) for s, f in data_files.items()}
        return real(path, data_files=local, **kw)

    monkeypatch.setattr(datasets, "load_dataset", from_local_copy)
    out = tmp_path / "out"
    assert cli(["glue", str(ckpt), "--tasks", "rte", *RECIPE, f"glue.output_dir={out}"]) == 0
    assert asked == [
        {
            "train": "hf://datasets/nyu-mll/glue/rte/train-00000-of-00001.parquet",
            "validation": "hf://datasets/nyu-mll/glue/rte/validation-00000-of-00001.parquet",
        }
    ]
    assert json.loads((out / "glue.json").read_text())["data"] == "hf://datasets/nyu-mll/glue"


def _gpt2_folder(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "case, error",
    [
        ("task", r"glue\.tasks\[1\]: must be one of cola, sst2, .* \(got 'sts'\)"),
        ("checkpoint", r"finetune\.checkpoint: .*gpt2.* is a 'gpt2' checkpoint; bert-mp finetune loads BERT"),
        (
            "folder",
            r"--data \(finetune\.glue_data\): .* has no rte/train-00000-of-00001\.parquet .*leave rte out",
        ),
    ],
)
def test_mistakes_are_one_line_before_any_training(case, error, glue_dir, tmp_path, cli, capsys):
    data, ckpt = glue_dir
    tasks = "cola,sts"
    if case == "checkpoint":
        ckpt, tasks = _gpt2_folder(tmp_path / "gpt2"), "cola"
    if case == "folder":
        partial = tmp_path / "partial"
        shutil.copytree(data / "cola", partial / "cola")
        data, tasks = partial, "cola,rte"
    out = tmp_path / "out"
    code = cli(["glue", str(ckpt), "--data", str(data), "--tasks", tasks, *RECIPE, f"glue.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("bert-mp glue: error: ")
    assert __import__("re").search(error, err[0]), err[0]
    assert not out.exists()  # nothing trained, no folder made


def test_each_task_gets_the_config_recipe_under_the_command_lines_overrides():
    from support import ROOT

    from bert_mp.finetune.glue import task_config
    from bert_mp.finetune.glue_args import load_request

    recipe = str(ROOT / "configs" / "glue_bert.yaml")
    req = load_request("ckpt", recipe, ["finetune.learning_rate=3e-5"], "glue/", "mrpc,cola")
    assert req.cfg.glue.tasks == ["mrpc", "cola"] and req.cfg.finetune.glue_data == "glue/"
    mrpc = task_config(req, "mrpc").finetune
    assert (mrpc.task, mrpc.epochs, mrpc.learning_rate) == ("glue/mrpc", 5, 3e-5)  # recipe, then overrides
    cola = task_config(load_request("ckpt", recipe, [], None, None), "cola").finetune
    assert (cola.epochs, cola.learning_rate, cola.batch_size, cola.max_seq_length) == (3, 2e-5, 32, 128)
    assert cola.output_dir == "runs/glue/cola" and cola.checkpoint == "ckpt"
