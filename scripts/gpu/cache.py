"""Inductor's caches carried from one command to the next, so a lease pays each compile and each tuning
once: every phase's children compile into :func:`cache_dir` (``TORCHINDUCTOR_CACHE_DIR``: FX graphs,
AOT autograd graphs, autotuning results, Triton kernels); after each phase the command packs it into
``$OUT/inductor_cache.tar.gz`` (one file, under the size a returned file may have); the next command
carries that file in (``carry=[".gpu_cache"]``, the archive copied to ``.gpu_cache/``) and unpacks it
before its first phase."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

from gpu import settings

ARCHIVE = "inductor_cache.tar.gz"


def cache_dir() -> Path:
    """The children's TORCHINDUCTOR_CACHE_DIR (:func:`gpu.child.child_env`), in this machine's state."""
    return settings.STATE / "inductor_cache"


def carried_archive() -> Path:
    """Where a command finds the previous command's archive (``carry=[".gpu_cache"]``)."""
    return settings.ROOT / settings.CARRIED_DIR / ARCHIVE


CAP_BYTES = 15 * 2**20
"""A returned file may have 16 MiB; with the carried wheels (8.6 MiB) it stays under the 64 MiB a
command's working tree may carry."""
KEEP_WHEN_LARGE = ("fxgraph", "aotautograd")
"""What a too-large archive keeps (with every ``*.best_config``, the coordinate-descent results): the
compiled graphs, whose kernels inductor rebuilds from them without tuning again."""


def unpack_carried(archive: Path | None = None, dest: Path | None = None) -> dict[str, Any]:
    """Unpack a carried archive into the cache folder (files already there are kept); what it held."""
    archive, dest = archive or carried_archive(), dest or cache_dir()
    if not archive.is_file():
        return {"carried": False}
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        tar.extractall(dest, members=members, filter="data")
    return {"carried": True, "bytes": archive.stat().st_size, "files": sum(m.isfile() for m in members)}


def _files(src: Path, keep: tuple[str, ...] | None) -> list[Path]:
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
    if keep is None:
        return files
    return [p for p in files if p.relative_to(src).parts[0] in keep or p.name.endswith(".best_config")]


def pack(out: Path, src: Path | None = None, cap: int = CAP_BYTES) -> dict[str, Any]:
    """The cache folder as ``out/inductor_cache.tar.gz`` (replaced whole, never half-written): everything,
    or where that passes ``cap``, the compiled graphs and tuning results alone; nothing (and no file)
    when even those pass it or there is nothing to pack."""
    src, target = src or cache_dir(), out / ARCHIVE
    for keep, label in ((None, "all"), (KEEP_WHEN_LARGE, "graphs and tuning results")):
        files = _files(src, keep) if src.is_dir() else []
        if not files:
            target.unlink(missing_ok=True)
            return {"packed": False, "reason": f"{src} holds no cache files"}
        tmp = out / (ARCHIVE + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(src)))
        size = tmp.stat().st_size
        if size <= cap:
            tmp.replace(target)
            return {"packed": True, "contents": label, "files": len(files), "bytes": size}
        tmp.unlink()
    target.unlink(missing_ok=True)
    return {"packed": False, "reason": f"over {cap} bytes even without the kernels ({size} bytes)"}
