"""A model reference that is not a local folder: one quick question to the Hub, never a wait on retries.

``from_pretrained`` on an unreachable Hub retries five times (about 25 s) before it fails or falls back
to the cache. A command that takes a model reference asks once instead - a single request for the
repository's file, no retries - and answers at once: the name is on the Hub, it is not, or the Hub
cannot be reached (then the local cache, if it holds the model, stands in). Local-looking references
(:func:`bert_mp.core.storage.files.looks_like_local_path`) never get here.
"""

from __future__ import annotations

from pathlib import Path

from bert_mp.errors import ConfigError

HUB_TIMEOUT_S = 10.0
"""Seconds the one request may take (connect and read)."""

_ANSWERS: dict[tuple, str] = {}
"""What this process resolved before, by (reference, file, offline, Hub address): the CLI checks a reference before the
command's libraries load, the command checks it again; the Hub is asked once."""


def _cached_folder(ref: str, filename: str) -> str | None:
    """The local cache's snapshot folder of ``ref`` when it holds ``filename``, else None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref, filename)
    return str(Path(found).parent) if isinstance(found, str) else None


def resolve_hub_model(ref: str, key: str, filename: str = "config.json") -> str:
    """``ref`` itself when the Hub has it, the cached snapshot folder when the Hub cannot be reached (or
    ``HF_HUB_OFFLINE`` is set) but the cache has it; otherwise a one-line :class:`ConfigError` naming
    ``key``. ``filename`` is the file asked for (``config.json`` for a model). A reference resolved
    before in this process is not asked about again."""
    from huggingface_hub import constants

    memo = (ref, filename, constants.HF_HUB_OFFLINE, constants.HUGGINGFACE_CO_URL_TEMPLATE)
    if memo not in _ANSWERS:  # an error is not kept: asked again
        _ANSWERS[memo] = _ask(ref, key, filename)
    return _ANSWERS[memo]


def _ask(ref: str, key: str, filename: str) -> str:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        cached = _cached_folder(ref, filename)
        if cached:
            return cached
        raise ConfigError(
            f"{key}: {ref} is neither a local folder nor in the Hub cache (HF_HUB_OFFLINE=1: the Hub is not "
            "asked); give a folder's path"
        )
    try:  # one request, no retries (retry_on_errors defaults to False)
        get_hf_file_metadata(hf_hub_url(ref, filename), timeout=HUB_TIMEOUT_S)
        return ref
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}: {ref} is neither a local folder nor a model on the Hub (a private one needs "
            "`hf auth login`)"
        ) from None
    except RemoteEntryNotFoundError:
        raise ConfigError(f"{key}: {ref} on the Hub has no {filename}: not a transformers model") from None
    except ValueError as e:  # not a valid repository name
        raise ConfigError(
            f"{key}: {ref} is neither a local folder nor a Hub name ({_first_line(e)})"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status is not None and status < 500:
            raise ConfigError(f"{key}: {ref} on the Hub: {_first_line(e)}") from None
        problem = _first_line(e)
    except Exception as e:  # the HTTP client's network errors: the Hub cannot be reached
        problem = _first_line(e) or type(e).__name__
    cached = _cached_folder(ref, filename)
    if cached:
        return cached
    raise ConfigError(
        f"{key}: {ref} is neither a local folder nor in the Hub cache, and the Hub cannot be reached "
        f"({problem}); give a folder's path"
    )


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""
