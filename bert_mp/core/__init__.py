"""The shared core under the products (data, model, pretrain, finetune, sweep), in rooms by concern.

Bottom up; a room imports only the rooms below it (``tests/unit/test_layering.py`` checks it):

1. :mod:`.storage` - files on disk: atomic writes and JSON lines, disk-space errors, content checksums,
   one writer per folder (an OS lock);
2. :mod:`.config` - the typed config tree, its checks, the torch-free precision mode names and the
   ``bert-mp config`` reference;
3. :mod:`.numerics` - what a precision means (autocast, scaler, backend flags, LayerNorm outputs), fp8,
   bf16 updates, subnormal flushing, the optimizers and schedules, Sophia and its Hessian estimate,
   the step's device-side scalars;
4. :mod:`.run` - the process and its machine: accelerator and distributed strategy (DDP, FSDP2 on CPU,
   DeepSpeed), ``bert-mp launch`` (its one-line reports, the ranks' watch on it) and several
   machines, the run conditions and start-up line, console lines and quiet libraries, hold points for
   tests, the Hub reference, the run folder's guard and lock;
5. :mod:`.checkpoint` - the checkpoint store (atomic save, verify, rotate, restore), the state codec
   without pickle, the Hugging Face folder writer;
6. :mod:`.loop` - the training loop's skeleton and state, the update after a backward, the callback
   protocol and shared monitors, the loss-parity callback, the checkpoint saver (when to save), the
   numerics guard, the run log and the epoch order.

Nothing here imports a product.
"""
