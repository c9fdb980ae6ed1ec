"""Where ``model.init_from`` comes from, checked without torch or transformers.

The CLI calls :func:`check_init_from` right after the config loads, so a mistyped folder or an unknown
Hub name is one line at once rather than after the model libraries' start-up; loading the weights
resolves it again, answered from the same process's memory (:mod:`bert_mp.model.hub`).
"""

from __future__ import annotations

from pathlib import Path

from bert_mp.core.config import ModelConfig
from bert_mp.errors import ConfigError


def check_init_from(model_cfg: ModelConfig) -> str | None:
    """What ``model.init_from`` loads: a local folder, or a Hub name asked about once (its cached copy
    where the Hub is out of reach). A local-looking path that is no folder fails at once."""
    from bert_mp.core.storage.files import looks_like_local_path
    from bert_mp.model.hub import resolve_hub_model

    source = model_cfg.init_from
    if not source:
        return None
    path = Path(source).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        raise ConfigError(
            f"model.init_from={source}: no config.json there (expected a save_pretrained folder)"
        )
    if path.is_dir():
        from bert_mp.core.checkpoint.hf_folder import verify_export

        verify_export(path, f"model.init_from={source}")
    if path.exists():
        return str(path)
    if looks_like_local_path(source):
        raise ConfigError(f"model.init_from={source}: no such folder")
    return resolve_hub_model(source, "model.init_from")
