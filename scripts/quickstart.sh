#!/usr/bin/env bash
# The README's first command: install into .venv, prepare the built-in offline corpus, then train the
# tiny model under fp32 (twice: a second seed measures the natural spread), bf16 and fp16 in one
# precision sweep and write its report (verdicts, speed ladder, memory, kernel check, plots).
# Extra arguments are dotted overrides for every step, e.g. `bash scripts/quickstart.sh train.max_steps=50`.
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh"
bert-mp prepare configs/quickstart.yaml "$@"
bert-mp sweep configs/quickstart_sweep.yaml "$@"
OUT="$(python -c 'import sys; from bert_mp.sweep.runner import load_sweep_config; print(load_sweep_config("configs/quickstart_sweep.yaml", sys.argv[1:])[0].sweep.output_dir)' "$@")"
echo
echo "Report: $OUT/report.md and $OUT/report.html (plots in $OUT/plots/, figures in $OUT/summary.json)"
echo "fp32 checkpoint for fine-tuning: $OUT/runs/fp32/final (loads with BertForPreTraining.from_pretrained)"
