"""The ``tests`` phase: the CUDA tests under pytest, each with its own timeout, counted from pytest's
JUnit report (or, when cut, from its verbose log); the full text of each failure kept."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from gpu import settings
from gpu.child import child_env, run_child, status


def phase_tests(args: argparse.Namespace) -> dict[str, Any]:
    junit = settings.STATE / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu or not slow"]
    cmd += ["-rfE", "--tb=long", f"--junitxml={junit}", *settings.GPU_TESTS]
    if os.environ.get(settings.TESTS_K_ENV):
        cmd += ["-k", os.environ[settings.TESTS_K_ENV]]
    env = child_env()
    env["BERT_MP_TEST_TIMEOUT"] = str(args.test_timeout)  # tests/conftest.py: SIGALRM per test
    rc, tail = run_child(cmd, args.budget, settings.STATE / "tests.log", env=env)
    counts, failed, failures = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}, [], {}
    if junit.exists():
        import xml.etree.ElementTree as ET

        for case in ET.parse(junit).getroot().iter("testcase"):
            bad = [c for c in case if c.tag in ("failure", "error")]
            name = f"{case.get('classname')}::{case.get('name')}"
            if bad:
                counts["failed" if bad[0].tag == "failure" else "errors"] += 1
                failed.append(name)
                # the whole text of the failure, not a tail: it goes to gpu_check.log
                failures[name] = (bad[0].get("message") or "") + "\n" + (bad[0].text or "")
            elif any(c.tag == "skipped" for c in case):
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    else:  # cut before pytest wrote its report: the verbose log still names each finished test
        for name, outcome in VERBOSE_RESULT.findall(
            (settings.STATE / "tests.log").read_text(errors="replace")
        ):
            key = {"PASSED": "passed", "SKIPPED": "skipped", "FAILED": "failed", "ERROR": "errors"}[outcome]
            counts[key] += 1
            if key in ("failed", "errors"):
                failed.append(name)
    return {
        "status": status(rc),
        "rc": rc,
        "per_test_timeout_s": args.test_timeout,
        "counts": counts,
        "failed": failed,
        "failures": failures,
        "tail": tail[-1500:],
    }


VERBOSE_RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b", re.MULTILINE)
