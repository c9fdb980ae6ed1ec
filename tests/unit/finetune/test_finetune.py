"""Fine-tuning: metrics, checkpoint hand-off, clear errors, tiny runs in this process (a run end to end
through the CLI: integration/test_finetune_cli.py)."""

import json
import math
import os
import re

import pytest
import torch
from safetensors import safe_open
from support import finetune_overrides as _overrides
from support import make_checkpoint, write_csv
from support import reset_accelerate as _reset_accelerate

from bert_mp.core.config import load_config
from bert_mp.errors import ConfigError, DataError, HardwareError
from bert_mp.finetune.metrics import classification_metrics
from bert_mp.finetune.model import build_classifier, check_vocab, resolve_checkpoint
from bert_mp.finetune.tasks import build_label_space, tokenize_split
from bert_mp.finetune.trainer import run_finetune


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------
def test_binary_metrics_match_hand_computation():
    y_true = [1, 1, 1, 0, 0, 0, 0, 1]
    y_pred = [1, 1, 0, 0, 0, 1, 0, 1]
    m = classification_metrics(y_true, y_pred)
    tp, tn, fp, fn = 3, 3, 1, 1
    assert m["accuracy"] == pytest.approx(6 / 8)
    assert m["mcc"] == pytest.approx(
        (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    )
    assert m["macro_f1"] == pytest.approx((0.75 + 0.75) / 2)


def test_multiclass_metrics_and_degenerate_cases():
    m = classification_metrics([0, 1, 2, 2], [0, 2, 2, 2])
    assert m["per_class_f1"] == {0: 1.0, 1: 0.0, 2: pytest.approx(0.8)}
    assert m["macro_f1"] == pytest.approx(1.8 / 3)
    assert classification_metrics([0, 1], [0, 1])["mcc"] == pytest.approx(1.0)
    assert classification_metrics([0, 1, 0], [1, 1, 1])["mcc"] == 0.0  # constant predictions
    assert classification_metrics([], [])["accuracy"] is None


# --------------------------------------------------------------------------------------------------
# the hand-off: BertForPreTraining export -> BertForSequenceClassification
# --------------------------------------------------------------------------------------------------
def test_roundtrip_only_cls_heads_unused_and_only_classifier_new(ckpt):
    labels = build_label_space(["neg", "pos", "mid"])
    model, loading = build_classifier(str(ckpt), labels, "pretrained", seed=0)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert loading["newly_initialized"] == ["classifier.bias", "classifier.weight"]
    assert loading["unused"] == sorted(k for k in saved if k.startswith("cls."))
    assert loading["unused"]  # the pretraining heads were in the file
    state = model.state_dict()
    for k, v in saved.items():
        if not k.startswith("cls."):
            assert torch.equal(state[k], v), k
    assert model.config.id2label == {0: "mid", 1: "neg", 2: "pos"}


def test_random_init_keeps_architecture_but_not_weights(ckpt):
    labels = build_label_space([0, 1])
    model, loading = build_classifier(str(ckpt), labels, "random", seed=0)
    pre, _ = build_classifier(str(ckpt), labels, "pretrained", seed=0)
    assert (
        loading["init"] == "random"
        and "bert.embeddings.word_embeddings.weight" in loading["newly_initialized"]
    )
    assert model.config.hidden_size == pre.config.hidden_size == 32
    w = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(model.state_dict()[w], pre.state_dict()[w])


def test_train_run_folder_means_its_final(ckpt):
    assert resolve_checkpoint(str(ckpt.parent)) == str(ckpt)


def test_not_a_bert_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not a BERT checkpoint \\(no config.json\\)"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="is a 'gpt2' checkpoint"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weights"):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(ConfigError, match="finetune.checkpoint: set it"):
        resolve_checkpoint(None)
    with pytest.raises(ConfigError, match="neither a local folder nor in the Hub cache"):
        resolve_checkpoint("no-such-org/no-such-bert-model")


def test_vocab_mismatch_is_a_clear_error(tmp_path, tok):
    check_vocab(tok, -(-len(tok) // 64) * 64, "ck", "tk")  # bert_mp's rounding to 64 is fine
    with pytest.raises(ConfigError, match="do not belong together"):
        check_vocab(tok, len(tok) - 1, "ck", "tk")
    with pytest.raises(ConfigError, match="do not belong together"):
        check_vocab(tok, len(tok) + 1000, "ck", "tk")
    big = make_checkpoint(tmp_path / "big", tok, vocab_size=len(tok) + 500)
    train = write_csv(tmp_path / "t.csv", 20)
    cfg = load_config(
        None, [f"finetune.checkpoint={big}", "finetune.task=local", f"finetune.train_file={train}"]
    )
    with pytest.raises(
        ConfigError, match=f"has {len(tok)} tokens but checkpoint .* has {len(tok) + 500} embeddings"
    ):
        run_finetune(cfg)


def test_max_seq_length_beyond_positions_names_the_key(tmp_path, ckpt):
    cfg = load_config(None, [f"finetune.checkpoint={ckpt}", "finetune.max_seq_length=65"])
    with pytest.raises(ConfigError, match="finetune.max_seq_length: 65 exceeds the checkpoint's 64 position"):
        run_finetune(cfg)


def test_long_texts_are_truncated_and_counted(tok):
    import datasets

    ds = datasets.Dataset.from_dict(
        {"text": ["apple " * 3, "stone " * 30, "river " * 14], "label_id": [0, 1, 0]}
    )
    out, n = tokenize_split(ds, tok, max_length=16, has_pair=False)
    assert n == 1
    assert [len(x) for x in out["input_ids"]] == [5, 16, 16]
    assert out["input_ids"][1][-1] == tok.sep_token_id
    assert out["label_id"] == [0, 1, 0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_record_the_plan(tmp_path, ckpt, precision):
    overrides = _overrides(ckpt, tmp_path, precision=precision, max_steps=3, save_model=False)
    # emulated where the CPU lacks the mode: this checks the plan, not the speed
    cfg = load_config(None, [*overrides, "hardware.allow_emulated=true"])
    s = run_finetune(cfg)
    assert s["precision"]["name"] == precision
    assert s["precision"]["autocast_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert s["steps"] == 3 and math.isfinite(s["validation"]["loss"])
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert ("amp/loss_scale" in rows[0]) == (precision == "fp16")
    assert not (tmp_path / "out" / "final").exists()


def test_precision_the_cpu_lacks_is_refused_naming_the_finetune_key(tmp_path, ckpt, monkeypatch):
    monkeypatch.setenv("BERT_MP_CPU_MASK", "all")  # as on an AVX2-only CPU
    cfg = load_config(None, _overrides(ckpt, tmp_path, precision="fp16", max_steps=1, save_model=False))
    with pytest.raises(
        HardwareError, match=r"^finetune\.precision=fp16 on CPU .*hardware\.allow_emulated=true"
    ):
        run_finetune(cfg)
    assert not (tmp_path / "out").exists()


def test_unseen_validation_labels_counted_or_refused(tmp_path, ckpt):
    val = write_csv(tmp_path / "val3.csv", 12, labels=("apple", "stone", "river"))
    cfg = load_config(None, _overrides(ckpt, tmp_path, validation_file=val, max_steps=2, save_model=False))
    s = run_finetune(cfg)
    assert s["task"]["unseen_labels"] == {"validation": {"river": 4}}
    assert s["validation"]["examples"] == 12
    assert s["validation"]["accuracy"] <= 8 / 12  # the 4 unseen ones can never be right
    assert "unseen:river" in s["validation"]["per_class_f1"]  # named by its label
    again = _overrides(ckpt, tmp_path, validation_file=val, unseen_labels="error", overwrite_output_dir=True)
    cfg = load_config(None, again)
    with pytest.raises(DataError, match="never seen in train: 'river' x4"):
        run_finetune(cfg)


def test_mistyped_local_checkpoint_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match=r"^finetune\.checkpoint: no such folder: runs/trian$"):
        resolve_checkpoint("runs/trian")


# --------------------------------------------------------------------------------------------------
# the shared training core: numerics guard, checkpoints, SIGTERM and resume
# --------------------------------------------------------------------------------------------------
def _classifier_with_hook(on_training_forward):
    """A ``build_classifier`` whose model calls ``on_training_forward(n)`` on its n-th training forward;
    what that returns (None: unchanged) replaces the embeddings' output."""
    calls = []

    def build(*args, **kwargs):
        model, info = build_classifier(*args, **kwargs)

        def hook(module, inputs, output):
            if not module.training:
                return output
            calls.append(1)
            replaced = on_training_forward(len(calls), output)
            return output if replaced is None else replaced

        model.bert.embeddings.register_forward_hook(hook)
        return model, info

    return build


def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_fp16_nan_storm_stops_like_pretraining(tmp_path, ckpt):
    """Every forward from step 4 on is NaN: three skipped steps in a row save the last good state and
    stop with the numerics guard's message, the one pretraining stops with."""
    from bert_mp.core.checkpoint import store as ck
    from bert_mp.errors import TrainingError

    kw = dict(
        precision="fp16", max_steps=5, save_every=3, save_total_limit=3, max_consecutive_skipped_steps=3
    )
    kw.update(save_model=False, select_best=False)
    emulated = ["hardware.allow_emulated=true"]  # fp16 on every CPU, emulated where not native
    run_finetune(load_config(None, [*_overrides(ckpt, tmp_path / "clean", **kw), *emulated]))
    _reset_accelerate()
    storm = _classifier_with_hook(lambda n, out: out * float("nan") if n >= 4 else None)
    cfg = load_config(None, [*_overrides(ckpt, tmp_path / "run", **kw), *emulated])
    with pytest.raises(TrainingError) as err:
        run_finetune(cfg, build_classifier=storm)
    run = tmp_path / "run" / "out"
    assert re.fullmatch(
        r"fp16: 3 optimizer steps in a row overflowed \(loss scale \d+\); checkpoint saved to \S+step_00000003\. "
        r"Try finetune\.precision=bf16, a lower learning rate, or a smaller finetune\.fp16_init_scale\.",
        str(err.value),
    ), str(err.value)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 3 and summary["skipped_steps"] == 3
    assert ck.find_latest(run / "checkpoints").name == "step_00000003"
    clean = _safetensors(tmp_path / "clean" / "out" / "checkpoints" / "step_00000003" / "model.safetensors")
    saved = _safetensors(run / "checkpoints" / "step_00000003" / "model.safetensors")
    assert saved.keys() == clean.keys() and all(torch.equal(saved[k], clean[k]) for k in clean)


def test_nonfinite_fp32_loss_stops_with_a_checkpoint(tmp_path, ckpt):
    from bert_mp.errors import TrainingError

    poison = _classifier_with_hook(lambda n, out: out * float("nan") if n == 3 else None)
    cfg = load_config(None, _overrides(ckpt, tmp_path, max_steps=5, save_model=False))
    with pytest.raises(
        TrainingError, match=r"non-finite loss \(nan\) at step 3 in fp32; .*finetune\.warmup_ratio"
    ):
        run_finetune(cfg, build_classifier=poison)
    assert (tmp_path / "out" / "checkpoints" / "step_00000002" / "COMPLETE").is_file()


def test_epoch_sampler_follows_the_epoch_order_pretraining_uses():
    import numpy as np

    from bert_mp.core.loop.epochs import epoch_order
    from bert_mp.finetune.trainer import EpochSampler
    from bert_mp.pretrain.batches import epoch_order as pretraining_order

    sampler = EpochSampler(50, seed=3)
    sampler.set_epoch(2)
    assert pretraining_order is epoch_order and len(sampler) == 50
    assert list(sampler) == epoch_order(50, 3, 2).tolist()
    assert list(sampler) == np.random.default_rng([3, 2]).permutation(50).tolist()


def test_a_batch_size_the_processes_cannot_share_equally_names_the_key():
    from bert_mp.finetune.trainer import batch_geometry

    with pytest.raises(
        ConfigError, match=r"finetune\.batch_size=10 must be divisible by the number of processes \(3\)"
    ):
        batch_geometry(10, 3)
    with pytest.raises(
        ConfigError, match=r"each takes an equal share of every step; set finetune\.batch_size=12$"
    ):
        batch_geometry(10, 3)
    g = batch_geometry(12, 3)
    assert (g.global_batch, g.micro_batch, g.world, g.accumulation) == (12, 4, 3, 1)


def test_a_refused_resume_leaves_config_yaml_as_it_was(tmp_path, ckpt):
    """As in pretraining, config.yaml is written after the restore: a resume that fails keeps the old one."""
    from bert_mp.errors import TrainingError

    cfg = load_config(None, _overrides(ckpt, tmp_path, max_steps=2, save_every=1, save_model=False))
    run_finetune(cfg)
    _reset_accelerate()
    out = tmp_path / "out"
    saved = (out / "config.yaml").read_bytes()
    cfg.finetune.resume = str(out / "checkpoints" / "step_00000009")
    cfg.finetune.learning_rate = 1e-3
    with pytest.raises(TrainingError, match=r"^finetune\.resume=\S+step_00000009: cannot resume from it"):
        run_finetune(cfg)
    assert (out / "config.yaml").read_bytes() == saved


@pytest.mark.signals  # a SIGTERM sent to this process from inside the step: ordered by construction
def test_sigterm_then_resume_is_bit_identical(tmp_path, ckpt):
    """SIGTERM during step 4 (of 6 per epoch): the run saves and stops; resuming finishes the run with
    the same per-step losses, evaluations and final weights as an uninterrupted one."""
    import signal

    kw = dict(max_steps=9, select_best=True)
    ref = run_finetune(load_config(None, _overrides(ckpt, tmp_path / "ref", **kw)))
    _reset_accelerate()
    term = _classifier_with_hook(lambda n, out: os.kill(os.getpid(), signal.SIGTERM) if n == 4 else None)
    cfg = load_config(None, _overrides(ckpt, tmp_path / "run", **kw))
    stopped = run_finetune(cfg, build_classifier=term)
    assert stopped["status"] == "stopped" and stopped["steps"] == 4 and "SIGTERM" in stopped["stop_reason"]
    _reset_accelerate()
    cfg.finetune.resume = "latest"
    resumed = run_finetune(cfg)
    assert resumed["status"] == "completed" and resumed["resumed_from"].endswith("step_00000004")

    def rows(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "time/step_ms"} for line in lines]

    assert rows(tmp_path / "run" / "out") == rows(tmp_path / "ref" / "out")
    assert resumed["selected"] == ref["selected"] and resumed["test"] == ref["test"]
    a = _safetensors(tmp_path / "ref" / "out" / "final" / "model.safetensors")
    b = _safetensors(tmp_path / "run" / "out" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "precision, optimizer", [("bf16_pure", "lamb"), ("fp8", "sophia"), ("fp32", "stable_adamw")]
)
def test_finetune_takes_the_new_precisions_and_optimizers(tmp_path, ckpt, precision, optimizer):
    """The same shared plan and optimizer builder as pretraining; final/ holds fp32 weights."""
    overrides = _overrides(ckpt, tmp_path, precision=precision, optimizer=optimizer, max_steps=3)
    cfg = load_config(None, [*overrides, "hardware.allow_emulated=true", "finetune.sophia_update_period=2"])
    s = run_finetune(cfg)
    assert s["precision"]["name"] == precision and s["steps"] == 3
    assert math.isfinite(s["validation"]["loss"])
    with safe_open(str(tmp_path / "out" / "final" / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())  # noqa: SIM118
