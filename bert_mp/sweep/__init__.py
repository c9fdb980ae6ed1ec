"""``bert-mp sweep`` and ``bert-mp report``: precision sweeps, parity verdicts, reports."""
