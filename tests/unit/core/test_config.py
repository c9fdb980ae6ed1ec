import pytest
from support import ROOT

from bert_mp.cli import main
from bert_mp.core.config import Config, load_config
from bert_mp.errors import ConfigError

CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
RECIPES = [p for p in CONFIGS if "accelerate" not in p.parts]


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.data.max_seq_length == 128


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    load_config(path)


def test_overrides_apply_and_are_typed(tmp_path):
    cfg = load_config(
        None, ["train.micro_batch_size=8", "train.global_batch_size=16", "data.lowercase=false"]
    )
    assert cfg.train.micro_batch_size == 8 and cfg.data.lowercase is False


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.nope=1", "train.nope"),
        ("data.max_seq_length=abc", "data.max_seq_length"),
        ("data.max_seq_length=4", "data.max_seq_length"),
        ("data.max_seq_length=1024", "data.max_seq_length"),
        ("train.precision=fp4", "train.precision"),
        ("train.global_batch_size=33", "train.global_batch_size"),
        ("data.mlm_probability=1.5", "data.mlm_probability"),
        ("model.preset=huge", "model.preset"),
        ("bogus.key=1", "bogus"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    assert key in str(ei.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("does/not/exist.yaml")


def test_cli_reports_config_error_in_one_line(capsys):
    rc = main(["prepare", "data.max_seq_length=4"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "data.max_seq_length" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_cache_key_ignores_num_proc_but_not_seed():
    a = load_config(None, ["data.num_proc=1"]).data.cache_key()
    b = load_config(None, ["data.num_proc=4"]).data.cache_key()
    c = load_config(None, ["data.seed=7"]).data.cache_key()
    assert a == b != c


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.paths=corpus/a.txt", r"^data\.paths: expects a list, e\.g\. data\.paths=\[corpus/a\.txt\]"),
        ("train=3", r"^train: is a section, not a value; set its keys"),
        ("train.log_with=[tensorbord]", r"^train\.log_with\[0\]: unknown tracker; choose from .*tensorboard"),
    ],
)
def test_shape_and_tracker_mistakes_are_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_a_section_given_a_value_in_yaml_names_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny\n")
    with pytest.raises(ConfigError, match=r"^model: is a section, not a value.*bert-mp config model"):
        load_config(recipe)


def test_a_tracker_that_is_not_installed_is_refused(monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"train\.log_with\[0\]: tracker 'wandb' is not installed; pip install wandb"
    ):
        load_config(None, ["train.log_with=[wandb]"])
    assert load_config(None, ["train.log_with=[tensorboard]"]).train.log_with == ["tensorboard"]


def test_saved_config_is_omegaconfs_yaml(tmp_path):
    """save_config writes what OmegaConf would (lists, None, nested sections), without its cost."""
    from omegaconf import OmegaConf

    from bert_mp.core.config import load_config, save_config

    cfg = load_config(None, ["data.paths=[a.txt,b c.txt]", "train.log_with=[]", "model.init_from=null"])
    save_config(cfg, tmp_path / "config.yaml")
    assert (tmp_path / "config.yaml").read_text() == OmegaConf.to_yaml(OmegaConf.structured(cfg))
    assert load_config(str(tmp_path / "config.yaml"), []) == cfg


def _misspell(key: str) -> str:
    """One letter dropped from the middle: the commonest slip."""
    i = len(key) // 2
    return key[:i] + key[i + 1 :]


def test_every_key_of_every_section_misspelt_gets_a_did_you_mean_naming_it():
    from dataclasses import fields

    for section in fields(Config):
        for key in (f.name for f in fields(section.default_factory())):
            wrong = _misspell(key)
            with pytest.raises(ConfigError) as err:
                load_config(None, [f"{section.name}.{wrong}=1"])
            message = str(err.value)
            assert message.startswith(f"{section.name}.{wrong}: unknown key; did you mean "), message
            assert f"{section.name}.{key}" in message.split("?")[0], message
            assert message.endswith(f"(every key of {section.name}: bert-mp config {section.name})")


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("data.files=[a.txt]", "data.paths"),
        ("train.lr=0.1", "train.learning_rate"),
        ("train.batch_size=8", "train.global_batch_size or train.micro_batch_size"),
        ("model.max_seq_length=64", "data.max_seq_length"),
        ("trian.max_steps=3", "train"),
    ],
)
def test_other_names_for_a_key_and_keys_of_other_sections_are_suggested(override, meant):
    with pytest.raises(ConfigError, match="did you mean " + meant):
        load_config(None, [override])


def test_a_misspelt_key_in_a_yaml_recipe_is_named_the_same_way(tmp_path):
    (tmp_path / "r.yaml").write_text("data:\n  files: [a.txt]\n")
    with pytest.raises(ConfigError, match=r"^data.files: unknown key; did you mean data.paths\?"):
        load_config(tmp_path / "r.yaml")
