"""The shared core under the products (data, model, pretrain, finetune, sweep, launch), in rooms by concern.

Bottom up; a room imports only the rooms below it (``tests/unit/test_layering.py`` checks it):

1. :mod:`.storage` - files on disk: atomic writes and JSON lines, disk-space errors, content checksums,
   one writer per folder (an OS lock);
2. :mod:`.config` - the typed config tree, its checks and the torch-free precision mode names;
3. :mod:`.numerics` - what a precision means (autocast, scaler, backend flags, LayerNorm outputs), fp8,
   bf16 updates, subnormal flushing, the optimizers and schedules, Sophia and its Hessian estimate,
   the step's device-side scalars;
4. :mod:`.process` - the process a command runs in: console lines and quiet libraries, hold points
   for tests, the run conditions and start-up line, a rank's side of ``bert-mp launch`` (the watch,
   the relay of a stop, the note files, the ``accelerate launch`` command line), the run folder's
   guard and lock;
5. :mod:`.engine` - the parallel engine: accelerator, distributed strategy (DDP, FSDP2 on CPU,
   DeepSpeed), sharded states, and the one adapter for backward, accumulation boundary, gradient
   norm and clipping;
6. :mod:`.checkpoint` - the checkpoint store (atomic save, verify, rotate, restore), the state codec
   without pickle, the Hugging Face folder writer;
7. :mod:`.loop` - the training loop's skeleton, its set-up sequence and state, the update after a
   backward, the callback protocol and shared monitors, the checkpoint saver (when to save), the
   numerics guard, the run log and the epoch order.

Nothing here imports a product.
"""
