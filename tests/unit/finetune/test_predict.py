"""bert-mp predict's choices, without a model run: columns, sequence length (CLI runs:
integration/test_predict_agrees_cli.py)."""

from types import SimpleNamespace

import pytest

from bert_mp.errors import ConfigError, DataError
from bert_mp.finetune.predict import check_columns, choose_columns, sequence_limit
from bert_mp.finetune.tasks import TaskRecord

RECORD = TaskRecord("local", "review", "context", "license", 48, [3, 10], ["3", "10"], False)
MODEL = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
TOKENIZER = SimpleNamespace(model_max_length=32)


def test_columns_come_from_the_flags_then_the_record_then_text_and_label():
    cols = choose_columns(RECORD, None, None, None)
    assert (cols.text, cols.text_pair, cols.label, cols.named) == (
        "review",
        "context",
        "license",
        frozenset(),
    )
    cols = choose_columns(RECORD, "body", None, None)
    assert (cols.text, cols.text_pair, cols.label, cols.named) == ("body", "context", "license", {"text"})
    cols = choose_columns(None, None, None, None)
    assert (cols.text, cols.text_pair, cols.label, cols.named) == ("text", None, "label", frozenset())


def test_a_missing_named_column_is_an_error_a_missing_default_label_means_no_metrics():
    present = ["review", "context"]
    assert check_columns(choose_columns(RECORD, None, None, None), present, "f.csv").label is None
    with pytest.raises(
        DataError, match=r"^f\.csv has no column 'license' \(columns: review, context\); set --label-column$"
    ):
        check_columns(choose_columns(RECORD, None, None, "license"), present, "f.csv")
    with pytest.raises(DataError, match="no column 'context'.*set --text-pair-column$"):
        check_columns(choose_columns(RECORD, None, None, None), ["review", "license"], "f.csv")


def test_sequence_length_flag_then_finetuning_length_then_tokenizer_limit():
    assert sequence_limit(MODEL, TOKENIZER, RECORD, None) == 48
    assert sequence_limit(MODEL, TOKENIZER, None, None) == 32
    assert sequence_limit(MODEL, TOKENIZER, RECORD, 64) == 64
    for bad in (65, 4):
        with pytest.raises(ConfigError, match=rf"^--max-seq-length: {bad} is outside 8\.\.64"):
            sequence_limit(MODEL, TOKENIZER, RECORD, bad)
