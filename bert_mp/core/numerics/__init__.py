"""What the numbers are made of: :mod:`.precision` (the one place that maps a precision name to autocast,
loss scaling and backend flags, and records what took effect), :mod:`.autocast_norms` (16-bit LayerNorm
outputs under autocast), :mod:`.fp8` (torchao float8 Linears), :mod:`.bf16_updates` (compensated updates
of bf16 weights), :mod:`.subnormal` (flushing subnormal floats on CPU threads), :mod:`.optimizers`
(optimizers, parameter groups and schedules), :mod:`.sophia` / :mod:`.hessian` (the Sophia optimizer and
its Hutchinson Hessian estimate) and :mod:`.step_scalars` (a step's figures kept on the device).
Imports :mod:`bert_mp.core.storage` and :mod:`bert_mp.core.config` only."""
