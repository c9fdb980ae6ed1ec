"""scripts/gpu/ (the GPU check) on CPU: the wheel choice against a machine's packages, the summary assembled
from recorded phase files (targets, tables), and the dry-run plumbing of the summary phase."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest
from support import load_script

check = load_script("gpu/check")
child = load_script("gpu/child")
cuda_tests = load_script("gpu/cuda_tests")
install = load_script("gpu/install")
rehearse = load_script("gpu/rehearse")
settings = load_script("gpu/settings")
summary = load_script("gpu/summary")
sweep = load_script("gpu/sweep")


def _wheel(d: Path, name: str, version: str, requires: list[str]) -> Path:
    path = d / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


@pytest.fixture
def wheels(tmp_path):
    w = [
        _wheel(
            tmp_path,
            "datasets",
            "5.2.0",
            [
                "pyarrow>=24.0.0",
                "dill<0.4.2,>=0.3.0",
                "fsspec<=2026.9.0",
                "huggingface-hub>=1.31.0",
                "multiprocess<0.70.20",
                "xxhash",
            ],
        ),
        _wheel(
            tmp_path,
            "datasets",
            "4.0.0",
            [
                "pyarrow>=15.0.0",
                "dill<0.3.9,>=0.3.0",
                "fsspec[http]<=2025.3.0",
                "huggingface-hub>=0.24.0",
                "multiprocess<0.70.17",
                "xxhash",
                'tomli; python_version < "3.0"',
                "tqdm; extra == 'dev'",
            ],
        ),
        _wheel(tmp_path, "dill", "0.4.1", []),
        _wheel(tmp_path, "dill", "0.3.8", []),
        _wheel(tmp_path, "multiprocess", "0.70.19", ["dill>=0.4.1"]),
        _wheel(tmp_path, "multiprocess", "0.70.16", ["dill>=0.3.8"]),
        _wheel(tmp_path, "fsspec", "2026.9.0", []),
        _wheel(tmp_path, "fsspec", "2025.3.0", []),
        _wheel(tmp_path, "omegaconf", "2.4.0", ["PyYAML>=5.1.0"]),
    ]
    return w


def _names(chosen):
    return {k: v.name.split("-")[1] for k, v in chosen.items()}


def test_newest_datasets_when_the_machine_allows_it(wheels):
    machine = {
        "pyarrow": "24.0.1",
        "huggingface-hub": "1.33.0",
        "xxhash": "3.6.0",
        "fsspec": "2026.9.0",
        "pyyaml": "6.0.3",
    }
    chosen, problems = install.choose_wheels(wheels, machine)
    assert problems == []
    # the machine's own fsspec / xxhash fit: not carried
    assert _names(chosen) == {
        "datasets": "5.2.0",
        "dill": "0.4.1",
        "multiprocess": "0.70.19",
        "omegaconf": "2.4.0",
    }


def test_older_datasets_when_pyarrow_is_older(wheels):
    machine = {
        "pyarrow": "21.0.0",
        "huggingface-hub": "1.33.0",
        "xxhash": "3.6.0",
        "fsspec": "2026.9.0",
        "pyyaml": "6.0",
    }
    chosen, problems = install.choose_wheels(wheels, machine)
    assert problems == []
    assert _names(chosen) == {
        "datasets": "4.0.0",
        "dill": "0.3.8",
        "multiprocess": "0.70.16",
        "fsspec": "2025.3.0",
        "omegaconf": "2.4.0",
    }


def test_nothing_fits_is_reported(wheels):
    chosen, problems = install.choose_wheels(
        wheels, {"pyarrow": "12.0", "huggingface-hub": "1.0", "pyyaml": "6.0"}
    )
    assert "datasets" not in chosen and len(problems) == 1 and "pyarrow" in problems[0]
    # already installed: nothing to do
    chosen, problems = install.choose_wheels(wheels, {"datasets": "3.0", "omegaconf": "2.3"})
    assert chosen == {} and problems == []


def _bench(fp32, tf32, bf16, fp16, mfu_bf16):
    def r(tps, mfu=None):
        return {"tokens_per_sec": tps, "step_ms": 1000.0, "ratio_vs_baseline": tps / 100.0, "mfu": mfu}

    return {
        "device": "NVIDIA H100 80GB HBM3",
        "results": {
            "baseline_hf_fp32": r(100.0),
            "bert_mp_fp32": r(fp32, 0.6),
            "bert_mp_tf32": r(tf32),
            "bert_mp_bf16": r(bf16, mfu_bf16),
            "bert_mp_fp16": r(fp16),
        },
    }


def test_summary_from_recorded_phases(tmp_path):
    phases = {
        "install": {"status": "ok", "device": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0"}},
        "tests": {
            "status": "failed",
            "counts": {"passed": 11, "failed": 1, "skipped": 0},
            "failed": ["tests.test_gpu::test_x"],
        },
        "ladder": {
            "status": "ok",
            "bench": _bench(1000.0, 3500.0, 5200.0, 5400.0, 0.41),
            "kernels": {"fp32": {"verdict": "GEMMs: 0/70 launches on tensor cores"}, "bf16": "skipped: x"},
        },
        "compile": None,
        "sweep": None,
    }
    s = summary.build_summary(phases)
    t = s["targets"]
    assert t["tf32_speedup_vs_fp32"] == {"value": 3.5, "target": 3.0, "met": True}
    assert t["bf16_speedup_vs_fp32"]["value"] == 5.2 and t["bf16_speedup_vs_fp32"]["met"] is True
    assert t["bf16_mfu"]["met"] is False  # 41% < 45%
    assert (
        t["fp16_vs_bf16_gap"]["value"] == pytest.approx(5400 / 5200 - 1)
        and t["fp16_vs_bf16_gap"]["met"] is True
    )
    assert s["phases"] == {
        "install": "ok",
        "tests": "failed",
        "ladder": "ok",
        "compile": "not run",
        "sweep": "not run",
    }
    assert s["targets_compiled"] is None and not s["dry_run"]
    md = summary.summary_markdown(s)
    assert "| bert_mp_bf16 | 5,200 |" in md and "| bf16_mfu | 41.0% | >= 45.0% | NO |" in md
    assert "FAILED tests.test_gpu::test_x" in md and "GEMMs: 0/70" in md
    json.dumps(s)  # serialisable


def test_targets_not_measured_without_a_ladder():
    s = summary.build_summary({"install": None})
    assert all(v["met"] is None for v in s["targets"].values())
    assert "not measured" not in summary.summary_markdown(s)  # no ladder, no table


def test_summary_phase_writes_out_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "STATE", tmp_path / "state")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ladder.json").write_text(
        json.dumps({"status": "ok", "dry_run": True, "bench": _bench(10.0, 30.0, 50.0, 50.0, None)})
    )
    assert check.main([str(tmp_path / "out"), "summary"]) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["dry_run"] is True and s["targets"]["bf16_mfu"]["met"] is None
    assert (tmp_path / "out" / "ladder.json").exists() and "dry run" in (
        tmp_path / "out" / "summary.md"
    ).read_text()


def test_docstring_corpus(tmp_path):
    pkg = tmp_path / "site-packages" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text(
        '"""A module docstring that is long enough to keep as text."""\ndef f():\n    """Short."""\n'
    )
    (pkg / "b.py").write_text("def broken(:\n")
    info = sweep.write_docstring_corpus(tmp_path / "corpus", 10_000, roots=[tmp_path / "site-packages"])
    assert info["documents"] == 1 and info["files"] == 1
    text = (tmp_path / "corpus" / "corpus_00.txt").read_text()
    assert text.startswith("A module docstring") and "Short." not in text


def _sandbox(tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "STATE", tmp_path / "state")
    monkeypatch.setattr(settings, "SITE", tmp_path / "site")
    (tmp_path / "state").mkdir()


@pytest.mark.parametrize("measured", [True, False], ids=["cut-after-a-row", "hang"])
def test_a_fresh_machine_installs_first_and_a_cut_phase_keeps_its_rows_or_hung(
    tmp_path, monkeypatch, measured
):
    """No install record in .gpu_site: install runs before the asked phases. A ladder cut at its
    budget still returns (and publishes) every row its child wrote before the cut, and the rehearsal's
    verdict on the command (gpu/rehearse.py) is a slow machine's cut: not ok, not hung, its row
    counted. The same child with no row written is a hang: the verdict names the phase."""
    _sandbox(tmp_path, monkeypatch)
    calls = []

    def install(args):
        calls.append("install")
        settings.SITE.mkdir()
        (settings.SITE / settings.INSTALLED).write_text("{}")
        return {"status": "ok", "device": "cpu"}

    def ladder(args):
        calls.append("ladder")
        bench = settings.STATE / "bench.json"
        # the row a child had measured before it hung: written here, before the child starts, so the
        # cut cannot come before it on a slow machine; the child stands for the hang alone
        if measured:
            bench.write_text(
                json.dumps({"partial": True, "results": {"bert_mp_fp32": {"tokens_per_sec": 10.0}}})
            )
        code = "import signal; signal.pause()"  # hangs until the budget cut signals it: no timing
        rc, _ = child.run_child(
            [sys.executable, "-c", code], args.budget, settings.STATE / "c.log", tick=lambda: None
        )
        return {"status": child.status(rc), "rc": rc, "bench": child.read_json(bench)}

    monkeypatch.setitem(check.RUNNERS, "install", install)
    monkeypatch.setitem(check.RUNNERS, "ladder", ladder)
    out = tmp_path / "out"
    rc = check.main([str(out), "ladder", "--budget", "ladder=3", "--deadline", "300"])
    assert rc == 1 and calls == ["install", "ladder"]
    res = json.loads((out / "ladder.json").read_text())
    s = json.loads((out / "summary.json").read_text())
    assert res["status"] == "timeout" and s["phases"]["ladder"] == "timeout"
    assert "ladder: timeout" in (out / "gpu_check.log").read_text()
    verdict = rehearse.judge(out, ["ladder"], rc)
    assert not verdict["ok"] and verdict["statuses"] == {"install": "ok", "ladder": "timeout"}
    if measured:
        assert res["bench"]["results"]["bert_mp_fp32"]["tokens_per_sec"] == 10.0
        assert s["ladder"][0]["run"] == "bert_mp_fp32"
        assert verdict["hung"] == [] and verdict["rows"] == {"ladder": 1}
    else:
        assert verdict["hung"] == ["ladder"] and verdict["rows"] == {"ladder": 0}
    # the next command on the same machine finds the install
    calls.clear()
    check.main([str(out), "summary"])
    assert calls == []


@pytest.mark.parametrize(
    ("phase", "summary", "rows"),
    [
        ("tests", {"tests": {"passed": 2, "failed": 1, "skipped": 0, "errors": 0}}, 3),
        ("tests", {"tests": None}, 0),
        ("sweep", {"sweep_runs": {"runs/fp32": {"steps": 4}, "runs/bf16": {"steps": 0}}}, 1),
        (
            "large",
            {"large": {"setup": {}, "speed": {"bf16": {"tokens_per_sec": 5.0}}, "fp8_parity": None}},
            1,
        ),
        ("large", {"large": {"setup": {"seq": 32}, "speed": {}, "fp8_parity": None}}, 0),
        ("levers", {"levers": [{"lever": "eager"}, {"lever": "cuda_graphs"}]}, 2),
        ("kernels", {"kernel_check": None}, 0),
    ],
)
def test_what_a_phase_measured_is_counted_from_the_summary(phase, summary, rows):
    """A sweep's run counts once it trained a step; BERT-large once a speed (or fp8's verdict) is in."""
    assert rehearse.produced(summary, phase) == rows


def test_out_never_gets_more_than_eight_files(tmp_path, monkeypatch):
    _sandbox(tmp_path, monkeypatch)
    for name in ("install", "ladder", "tests", "kernels", "compile", "sweep"):
        (settings.STATE / f"{name}.json").write_text(json.dumps({"status": "ok"}))
    assert check.main([str(tmp_path / "out"), "summary"]) == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) == settings.MAX_OUT_FILES and "install.json" not in files
    assert {"summary.json", "summary.md", "gpu_check.log", "sweep.json"} <= set(files)


def test_failing_tests_are_logged_in_full(tmp_path, monkeypatch):
    _sandbox(tmp_path, monkeypatch)
    long_text = "Traceback\n" + "x" * 20_000 + "\nAssertionError: the end"
    (settings.STATE / "tests.json").write_text(
        json.dumps({"status": "failed", "failures": {"tests/t.py::test_a": long_text}})
    )
    pub = check.Publisher(tmp_path / "out", ["tests"])
    pub.publish()
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "===== FAILED tests/t.py::test_a =====" in log and long_text in log


def test_too_many_phases_for_one_command_are_refused(tmp_path, monkeypatch):
    _sandbox(tmp_path, monkeypatch)
    with pytest.raises(SystemExit):
        check.main([str(tmp_path / "out"), "install", "ladder", "tests", "kernels", "compile", "sweep"])


def test_a_cut_pytest_run_is_counted_from_its_verbose_log():
    log = (
        "tests/unit/pretrain/test_gpu.py::test_a PASSED    [ 10%]\n"
        "tests/unit/pretrain/test_gpu.py::test_b[fp16] FAILED   [ 20%]\n"
        "tests/unit/core/test_cuda_paths.py::test_c SKIPPED (needs a CUDA device) [ 30%]\n"
    )
    found = cuda_tests.VERBOSE_RESULT.findall(log)
    assert [o for _, o in found] == ["PASSED", "FAILED", "SKIPPED"]
    assert found[1][0] == "tests/unit/pretrain/test_gpu.py::test_b[fp16]"


def test_bench_rows_are_written_as_they_are_measured(tmp_path):
    import torch

    bench = load_script("bench/train")
    out = tmp_path / "bench.json"
    rows = {"baseline_hf_fp32": {"tokens_per_sec": 5.0}}
    bench.write_progress(str(out), torch.device("cpu"), [], rows)
    first = json.loads(out.read_text())
    assert first["partial"] is True and first["results"] == rows
    rows["bert_mp_fp32"] = {"tokens_per_sec": 6.0}
    bench.write_progress(str(out), torch.device("cpu"), [], rows)
    assert list(json.loads(out.read_text())["results"]) == ["baseline_hf_fp32", "bert_mp_fp32"]
    assert [r["run"] for r in summary.ladder_rows(json.loads(out.read_text()))] == list(rows)


def test_profile_rows_and_their_lines():
    report = {
        "paths": {
            "padded": {
                "bench": {"tokens_per_sec": 400000.0},
                "device_ms_per_step": 60.0,
                "busy_fraction": 0.75,
                "time": "CUDA kernels' device time",
                "groups": {
                    "gemm": {"device_us": 3.0, "share": 0.6},
                    "layernorm": {"device_us": 2.0, "share": 0.4},
                },
            }
        }
    }
    rows = summary.profile_rows(report)
    assert rows == [
        {
            "path": "padded",
            "tokens_per_sec": 400000.0,
            "kernel_ms_per_step": 60.0,
            "busy_fraction": 0.75,
            "time": "CUDA kernels' device time",
            "shares": {"gemm": 0.6, "layernorm": 0.4},
        }
    ]
    s = summary.build_summary({"profile": {"status": "ok", "profile": report}})
    assert s["profile"] == rows and s["phases"] == {"profile": "ok"}
    md = summary.summary_markdown(s)
    assert (
        "- padded: 400,000 tokens/s under the profiler, 60.0 ms of kernels a step (75.0% of the step): gemm 60.0%, layernorm 40.0%"
        in md
    )
    assert summary.profile_rows(None) == []


def test_the_inductor_cache_is_packed_into_out_and_unpacked_by_the_next_command(tmp_path, monkeypatch):
    """A command packs its children's TORCHINDUCTOR_CACHE_DIR into OUT (under a returned file's size;
    too large: the compiled graphs and tuning results alone); the next one, given it in .gpu_cache/,
    unpacks it before its phases. Eight files at most still come back."""
    import random

    cache = load_script("gpu/cache")
    _sandbox(tmp_path, monkeypatch)
    monkeypatch.setattr(settings, "ROOT", tmp_path / "repo")
    src = cache.cache_dir()
    assert child.child_env()["TORCHINDUCTOR_CACHE_DIR"] == str(src)
    noise = random.Random(0).randbytes(200_000)  # does not compress: the kernels' share of the size
    for rel, data in {
        "fxgraph/ab/entry": b"graph" * 100,
        "aotautograd/cd/entry": b"aot" * 100,
        "triton/0/kernel.cubin": noise,
        "3g/k.best_config": b"{}",
        "fxgraph/ab/entry.lock": b"",
    }.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    assert cache.pack(out)["contents"] == "all"
    small = cache.pack(out, cap=100_000)  # the kernels do not fit: graphs and tuning results do
    assert small["contents"] == "graphs and tuning results" and small["files"] == 3
    (settings.ROOT / settings.CARRIED_DIR).mkdir(parents=True)
    (out / cache.ARCHIVE).rename(cache.carried_archive())
    dest = tmp_path / "next_machine"
    assert cache.unpack_carried(dest=dest) == {
        "carried": True,
        "bytes": cache.carried_archive().stat().st_size,
        "files": 3,
    }
    assert (dest / "fxgraph/ab/entry").read_bytes() == b"graph" * 100 and (dest / "3g/k.best_config").exists()
    assert not (dest / "triton").exists() and not (dest / "fxgraph/ab/entry.lock").exists()
    assert cache.pack(out, cap=100)["packed"] is False and not (out / cache.ARCHIVE).exists()
    assert cache.unpack_carried(archive=tmp_path / "none.tar.gz") == {"carried": False}
    # with an archive in OUT the phase files give way first: never more than eight files
    cache.pack(out)
    for name in ("install", "ladder", "tests", "kernels", "compile", "sweep"):
        (settings.STATE / f"{name}.json").write_text(json.dumps({"status": "ok"}))
    check.Publisher(out, ["summary"]).publish()
    files = {p.name for p in out.iterdir()}
    assert len(files) == settings.MAX_OUT_FILES and cache.ARCHIVE in files and "summary.json" in files
