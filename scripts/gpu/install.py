"""The ``install`` phase: the carried wheels a bare machine lacks, chosen against the machine's own packages
(pure: tested on CPU with fake wheels), installed into ``.gpu_site/``; the device and versions recorded."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

from gpu import settings
from gpu.child import child_env, clean_env


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_info(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, unconditional Requires-Dist) read from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode("utf-8"))
    reqs = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return _canon(meta["Name"]), meta["Version"], reqs


def choose_wheels(
    wheels: list[Path], installed: dict[str, str], wanted: tuple[str, ...] = ("datasets", "omegaconf")
) -> tuple[dict[str, Path], list[str]]:
    """Pick carried wheels so that ``wanted`` and their requirements are met.

    ``installed`` maps canonical names to the machine's versions; those are used where they satisfy a
    requirement (a carried wheel never replaces a working installed package). Candidates of a wanted
    package are tried newest first. Returns ``(chosen name -> wheel, problems)``; ``problems`` lists
    requirements nothing satisfies (empty when the choice is complete).
    """
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.version import Version

    env = default_environment()
    by_name: dict[str, list[tuple[Version, Path, list[str]]]] = {}
    for w in wheels:
        name, version, reqs = wheel_info(w)
        by_name.setdefault(name, []).append((Version(version), w, reqs))
    for cands in by_name.values():
        cands.sort(key=lambda c: c[0], reverse=True)

    def resolve(req: Requirement, chosen: dict[str, tuple[Version, Path, list[str]]], depth: int) -> bool:
        name = _canon(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            return True
        if name in chosen:
            return req.specifier.contains(chosen[name][0], prereleases=True)
        if name in installed and req.specifier.contains(installed[name], prereleases=True):
            return True
        if depth > 4:
            return False
        for cand in by_name.get(name, []):
            if not req.specifier.contains(cand[0], prereleases=True):
                continue
            trial = {**chosen, name: cand}
            if all(resolve(Requirement(r), trial, depth + 1) for r in cand[2]):
                chosen.update(trial)
                return True
        return False

    chosen: dict[str, tuple[Version, Path, list[str]]] = {}
    problems = []
    for name in wanted:
        if name in installed:
            continue
        if not resolve(Requirement(name), chosen, 0):
            cands = by_name.get(name, [])
            unmet = []
            for _, _, reqs in cands[:1]:
                for r in reqs:
                    if not resolve(Requirement(r), dict(chosen), 1):
                        unmet.append(r)
            problems.append(
                f"{name}: no carried version fits this machine (unmet: {', '.join(unmet) or 'no wheel'})"
            )
    return {n: c[1] for n, c in chosen.items()}, problems


def installed_versions(python: str) -> dict[str, str]:
    """Canonical name -> version of every distribution ``python`` sees (its own site-packages)."""
    code = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, env=clean_env())
    return {_canon(k): v for k, v in json.loads(out.stdout).items()}


def _device_info() -> dict[str, Any]:
    """The device and the versions this machine's Python finds, carried ``.gpu_site/`` first (the
    environment every later phase runs in). Only torch is imported (for the device); the rest are read
    from their installed metadata: importing transformers, datasets and bert_mp's trainer here cost
    4-5 CPU s per command (every command starts on a fresh machine), and the first phase imports
    them anyway, failing with the import's own error."""
    code = (
        "import importlib.metadata as m, importlib.util as u, json, sys, torch\n"
        "d = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda}\n"
        "for n in ('transformers', 'accelerate', 'datasets', 'omegaconf', 'pytest'): d[n] = m.version(n)\n"
        "spec = u.find_spec('bert_mp')\n"
        "assert spec is not None and spec.origin, 'bert_mp is not importable here'\n"
        "dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu (no CUDA)'\n"
        "cap = '.'.join(map(str, torch.cuda.get_device_capability(0))) if torch.cuda.is_available() else None\n"
        "print(json.dumps({'versions': d, 'device': dev, 'capability': cap, 'bert_mp': spec.origin}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=settings.ROOT, env=child_env(), capture_output=True, text=True
    )
    if out.returncode:
        return {"error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# phases: each returns its result dict and may call args.progress(partial) while it runs
# --------------------------------------------------------------------------------------------------
def phase_install(args: argparse.Namespace) -> dict[str, Any]:
    wheels = sorted(Path(args.wheels).glob("*.whl"))
    installed = installed_versions(sys.executable)
    missing = [n for n in settings.CARRIED if n not in installed]
    chosen, problems = choose_wheels(wheels, installed, settings.WANTED) if wheels else ({}, [])
    res: dict[str, Any] = {"machine_has": {n: installed.get(n) for n in settings.CARRIED}, "missing": missing}
    settings.SITE.mkdir(exist_ok=True)
    if chosen:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index"]
        cmd += ["--no-deps", "--upgrade", "--target", str(settings.SITE), *map(str, chosen.values())]
        out = subprocess.run(cmd, capture_output=True, text=True, env=clean_env())
        res["pip"] = {"rc": out.returncode, "tail": (out.stdout + out.stderr)[-2000:]}
    res["carried"] = {n: p.name for n, p in chosen.items()}
    res["problems"] = problems + (
        []
        if wheels or not missing
        else [f"no .wheels/ to install {missing} from: run scripts/gpu_wheels.sh here and carry .wheels"]
    )
    info = _device_info()
    res.update(info)
    res["status"] = "ok" if "error" not in info and not problems else "failed"
    if res["status"] == "ok":  # later phases of this machine find it; a fresh machine has none
        (settings.SITE / settings.INSTALLED).write_text(
            json.dumps({k: res.get(k) for k in ("device", "versions")})
        )
    return res
