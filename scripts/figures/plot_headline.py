"""The README's picture from a sweep folder: the loss per precision over the fp32 seed band, and the
speed ladder, with the device, versions and command under it.

    python scripts/figures/plot_headline.py runs/quickstart_sweep --out docs/headline.png

Run it on the folder that `bash scripts/quickstart.sh` writes; the figures are that run's own, and a
speed-up the report withholds is withheld here too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bert_mp.sweep import speed
from bert_mp.sweep.plots import plot_headline
from bert_mp.sweep.results import load_sweep, verdict_rules


def footer(record, group) -> str:
    """``bert-mp sweep configs/quickstart_sweep.yaml: tiny model, 100 steps; AMD EPYC (2 cores); torch ...``."""
    run = next((r for r in group.runs if r.summary and r.summary.conditions), None)
    cond = run.summary.conditions if run else {}
    versions = (run.summary.versions or {}) if run else {}
    cfg = record.config
    command = f"bert-mp sweep {record.sweep_file}" if record.sweep_file else "bert-mp sweep"
    machine = (
        f"{cond.get('cpu_model', '?')} ({cond.get('cores', '?')} cores)" if cond else "machine not recorded"
    )
    libs = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers") if k in versions)
    return f"{command}: {cfg['model']['preset']} model, {cfg['train']['max_steps']} steps; {machine}; {libs}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", help="a sweep folder (bert-mp sweep's output)")
    ap.add_argument("--out", default="docs/headline.png", help="the PNG to write")
    ap.add_argument("--group", default=None, help="the group to show (default: the first)")
    args = ap.parse_args(argv)
    record, groups = load_sweep(args.sweep_dir)
    group = next((g for g in groups if args.group in (None, g.name)), None)
    if group is None:
        raise SystemExit(f"plot_headline: no group {args.group!r} in {args.sweep_dir}")
    ladder, _ = speed.checked_ladder(group, float(record.config["sweep"]["speed_noise"]))
    out = plot_headline(group, verdict_rules(record), ladder, footer(record, group), Path(args.out))
    print(f"plot_headline: {out} ({out.stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
