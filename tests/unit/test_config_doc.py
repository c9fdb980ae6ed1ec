"""``bert-mp config``: the key reference comes from the config dataclasses themselves."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from bert_mp.config_reference import config_rows, describe_config
from bert_mp.core.config import Config
from bert_mp.errors import ConfigError


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:  # a section; an empty mapping (glue.recipes) is a key
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_every_key_is_listed_with_its_default_and_a_description():
    rows = config_rows()
    assert [r[0] for r in rows] == list(_leaves(asdict(Config())))
    defaults = _leaves(asdict(Config()))
    for key, tp, default, doc in rows:
        assert default == defaults[key], key
        assert tp and doc, f"{key} has no type or no docstring in bert_mp/core/config/"


def test_selectors_filter_and_unknown_ones_name_the_sections():
    text = describe_config("train.fp16")
    assert "train.fp16_init_scale: float = 65536.0" in text and "train.seed" not in text
    assert "[train]" in text and "[data]" not in text
    assert "hardware.allow_emulated: bool = false" in describe_config("hardware")
    with pytest.raises(ConfigError, match="no config key matches 'trian'.*sections: data, finetune"):
        describe_config("trian")


def test_each_loop_section_speaks_of_its_own_loop():
    """train and finetune share LoopConfig's fields; each section's text is about its own loop."""
    docs = {key: doc for key, _, _, doc in config_rows()}
    finetune = {k: d for k, d in docs.items() if k.startswith("finetune.")}
    train = {k: d for k, d in docs.items() if k.startswith("train.")}
    assert not [k for k, d in finetune.items() if "pretraining" in d or "masking" in d]
    assert not [k for k, d in train.items() if "fine-tun" in d or "finetune." in d]
    assert "fine-tuning steps" in finetune["finetune.save_every"]
    assert "end of pretraining" in train["train.save_every"]
