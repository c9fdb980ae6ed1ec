"""A sweep run's or downstream fine-tune's status and reason from what it left: its summary.json (or
none), its exit code and the last error line of its launch log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bert_mp.sweep.record import DownstreamEntry, RunEntry, record_outcome


def _summary(status, error=None, stop_reason=None):
    return SimpleNamespace(status=status, error=error, stop_reason=stop_reason)


def _entries(returncode):
    run = RunEntry("bf16", "default", "bf16", "candidate", 42, [], "runs/bf16")
    tune = DownstreamEntry("bf16", "default", "bf16", "candidate", "sst2", 1, "downstream/bf16/sst2-1")
    for e in (run, tune):
        e.returncode = returncode
    return run, tune


@pytest.mark.parametrize(
    ("summary", "returncode", "last_error", "status", "reason"),
    [
        # completed and exited 0: no reason, even with an old error line in the log
        (_summary("completed"), 0, "an old line", "completed", None),
        (_summary("completed"), None, None, "completed", None),  # not launched by the sweep (reused)
        # completed, then a non-zero exit (a crash in the export or at shut-down): a failure
        (_summary("completed"), 1, "RuntimeError: at exit", "failed", "RuntimeError: at exit"),
        (_summary("completed", error="disk full"), 3, "log line", "failed", "disk full"),
        # stopped or failed: the summary's own reason first, the log's last error line otherwise
        (_summary("stopped", stop_reason="SIGTERM"), 143, "log line", "stopped", "SIGTERM"),
        (_summary("failed", error="loss is NaN"), 3, "log line", "failed", "loss is NaN"),
        (_summary("failed"), 3, "log line", "failed", "log line"),
        # no summary written at all: failed, with the log's line (or nothing to say)
        (None, 1, "ImportError: no module", "failed", "ImportError: no module"),
        (None, 1, None, "failed", None),
    ],
)
def test_status_and_reason_from_summary_exit_and_log(summary, returncode, last_error, status, reason):
    for entry in _entries(returncode):
        record_outcome(entry, summary, last_error)
        assert (entry.status, entry.reason) == (status, reason)
