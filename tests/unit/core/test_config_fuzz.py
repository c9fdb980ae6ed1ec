"""Config fuzz: every key given a wrong type or an out-of-range value fails with the key's name."""

import dataclasses
import typing

import pytest

from bert_mp.core.config import Config, load_config
from bert_mp.errors import ConfigError


def _kind(hint) -> str:
    """bool / int / float / list / str for a field's type hint (Optional unwrapped)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) in (list,):
        return "list"
    return getattr(hint, "__name__", "other")


def _leaves():
    for section, section_type in typing.get_type_hints(Config).items():
        for name, hint in typing.get_type_hints(section_type).items():
            yield f"{section}.{name}", _kind(hint)


LEAVES = list(_leaves())
BAD_TYPE = {"bool": "maybe", "int": "not_a_number", "float": "not_a_number", "list": "{a: 1}"}
# Free-form strings (paths, names) have no wrong type: any value is a string.
TYPED = [(k, kind) for k, kind in LEAVES if kind in BAD_TYPE]


@pytest.mark.parametrize("key,kind", TYPED, ids=[k for k, _ in TYPED])
def test_wrong_type_names_the_key(key, kind):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [f"{key}={BAD_TYPE[kind]}"])
    assert key in str(ei.value)


NUMERIC = [(k, kind) for k, kind in LEAVES if kind in ("int", "float")]


@pytest.mark.parametrize("key,kind", NUMERIC, ids=[k for k, _ in NUMERIC])
def test_out_of_range_names_the_key(key, kind):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [f"{key}=-1000000000"])
    assert key in str(ei.value)


def test_fuzz_covers_every_section():
    sections = {k.split(".")[0] for k, _ in LEAVES}
    assert sections == {f.name for f in dataclasses.fields(Config)}
