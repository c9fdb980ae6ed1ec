"""Benchmarks: scripts that print a table and write JSON, each comparing bert_mp against a baseline
measured in the same run on the same machine (docs/benchmarks.md). :mod:`.harness` is what the
training benchmarks share (prepared examples, the plain HF loop, one measured ``bert-mp train`` run);
:mod:`.train` (precisions and encoder paths), :mod:`.levers` (the speed-lever ladder, BERT-large fp8),
:mod:`.profile_step` (device time per kernel class), :mod:`.prepare` and :mod:`.prepare_shards`
(``bert-mp prepare``), :mod:`.checkpoint`, :mod:`.cpu_precision`, :mod:`.memory_precision`,
:mod:`.processes`, :mod:`.scaling`, :mod:`.compile_determinism`, :mod:`.finetune_compare` and
:mod:`.scale_model` (docs/scale.md's projection from the measured rows). Run each as
``python scripts/bench/<name>.py``."""
