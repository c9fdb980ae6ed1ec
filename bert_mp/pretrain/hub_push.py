"""``bert-mp export RUN --push_to_hub REPO [--revision R] [--private]``: the exported folder handed to
the Hugging Face Hub through ``huggingface_hub``'s own upload.

The order is the safe one: the checkpoint is verified (sizes and digests) before it is read, the
folder is exported atomically, its weights are verified again against the ``checksums.json`` the
export wrote, and only then is anything sent - ``HfApi.create_repo`` (``exist_ok``: a second push
adds a commit), ``HfApi.create_branch`` for a ``--revision`` other than main (an intermediate
checkpoint as a branch: ``--revision step-1000``) and ``HfApi.upload_folder`` with the whole folder,
model card (``README.md``) included. The token is ``huggingface_hub``'s (``HF_TOKEN`` or ``hf auth
login``); a refusal of the Hub (no token, no network, no rights) is one line.
"""

from __future__ import annotations

from pathlib import Path

from bert_mp.core.checkpoint.hf_folder import verify_export
from bert_mp.errors import BertMPError, ConfigError


class HubPushError(BertMPError):
    """The Hub refused or could not be reached; the exported folder is complete on disk."""


def check_repo_id(repo_id: str) -> None:
    """``REPO`` is a Hub repository id (``user/name``), checked before any export work."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ConfigError(
            f"--push_to_hub: {repo_id!r} is not a Hub repository id ({str(e).splitlines()[0]})"
        ) from None
    if "/" not in repo_id:
        raise ConfigError(f"--push_to_hub: {repo_id!r}: give the owner too, as user/name or org/name")


def push_folder(folder: Path, repo_id: str, revision: str | None, private: bool, message: str) -> str:
    """Upload a verified export to ``repo_id`` (on branch ``revision``); returns the commit's URL."""
    from huggingface_hub import HfApi

    verify_export(folder, "--push_to_hub")  # the bytes about to leave are the ones the export wrote
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            revision=revision,
            commit_message=message,
        )
    except Exception as e:  # HTTP refusals, no token, no network: huggingface_hub's own words, one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HubPushError(
            f"--push_to_hub {repo_id}: the Hub refused the upload ({first}); the export is complete in "
            f"{folder}: log in (`hf auth login` or HF_TOKEN) and push it again"
        ) from None
    return str(getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}")
