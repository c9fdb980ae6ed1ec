"""The GPU check for a lent, bare GPU machine (docs/gpu.md): ``bash scripts/gpu_check.sh OUT PHASE ...``.

:mod:`.check` runs the phases of one command (budgets, deadline, what comes back) and is the entry
point; :mod:`.settings` holds the fixed facts (phases, the order of commands, budgets, wheels);
:mod:`.child` runs a phase's child process; one module per phase or family of phases (:mod:`.install`,
:mod:`.ladder`, :mod:`.levers`, :mod:`.cuda_tests`, :mod:`.kernels`, :mod:`.profiling`, :mod:`.sweep`);
:mod:`.summary` turns the phase files into summary.json / summary.md; :mod:`.rehearse` runs the whole
sequence on a CPU with tiny shapes.
"""
