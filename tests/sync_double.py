"""A CPU stand-in for the host syncs a step would make on an accelerator (CI has no GPU).

On a CPU every tensor already lives on the host, so nothing ever waits. :class:`HostSyncRecorder`
tracks which tensors *would* live on the accelerator and records every operation that would block
the host there:

- a **host read** of a device tensor: ``item``, ``tolist``, ``bool`` (an ``if`` on a tensor),
  ``float``/``int``/``index``, ``numpy``, ``cpu`` or ``to("cpu")``;
- a **blocking copy** to the device: ``torch.tensor`` / ``as_tensor`` / ``asarray`` / ``scalar_tensor``
  with a ``device`` argument (a synchronous copy of host memory), and ``host_tensor.to(device)``
  without ``non_blocking=True``.

Device tensors are the model's parameters (and what is read from them, gradients included),
whatever a factory creates with a ``device`` argument other than ``"cpu"``, a host tensor moved with
``.to(device)`` (given a copy of its own, so the host original stays a host tensor), and every
result of an operation with a device tensor among its inputs. It is a ``TorchFunctionMode``, so it
sees the Python-level calls of bert_mp, transformers, Accelerate and torch alike.

Phases (``recorder.phase(name)``, or :meth:`HostSyncRecorder.wrap`) name where an event happened;
``BERT_MP_SYNC_STACKS=1`` prints the full stack of each event.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_TAG = "_bert_mp_on_device"

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__format__,  # f"{loss:.3f}" reads a 0-d tensor
}
COPIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor}


def on_device(t: Any) -> bool:
    return isinstance(t, torch.nn.Parameter) or bool(getattr(t, _TAG, False))


def _tag(out: Any) -> Any:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            with contextlib.suppress(AttributeError, RuntimeError):
                setattr(t, _TAG, True)
    return out


def _is_host(device: Any) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _target_device(args: tuple, kwargs: dict) -> Any:
    """The device argument of a ``Tensor.to`` call, if any (a str or torch.device)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, torch.Tensor):  # to(other): other's placement
            return "device" if on_device(a) else "cpu"
    return None


@dataclass
class Event:
    kind: str
    """``read`` (device -> host) or ``copy`` (blocking host -> device)."""
    op: str
    phase: str
    where: str
    """The innermost bert_mp / transformers / accelerate frame that caused it."""


class HostSyncRecorder(TorchFunctionMode):
    """``with HostSyncRecorder() as rec:`` ... then ``rec.count("read", phase=...)``, ``rec.report()``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.phases: list[str] = ["outside"]
        self.calls: dict[str, int] = {}
        """How often each phase was entered."""

    # ---- bookkeeping -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.phases.append(name)
        self.calls[name] = self.calls.get(name, 0) + 1
        try:
            yield
        finally:
            self.phases.pop()

    def wrap(self, fn: Callable, name: str) -> Callable:
        def wrapped(*a: Any, **k: Any) -> Any:
            with self.phase(name):
                return fn(*a, **k)

        return wrapped

    def _record(self, kind: str, func: Any) -> None:
        stack = [fr for fr in traceback.extract_stack() if not fr.filename.endswith("sync_double.py")]
        where = "?"
        for keys in (("bert_mp/",), ("transformers/", "accelerate/"), ("torch/",)):
            fr = next((f for f in reversed(stack) if any(k in f.filename for k in keys)), None)
            if fr is not None:
                where = (
                    f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} {fr.name}"
                )
                break
        op = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        self.events.append(Event(kind, op, self.phases[-1], where))
        if os.environ.get("BERT_MP_SYNC_STACKS"):  # debugging a budget failure: where each event came from
            traceback.print_stack(limit=14)

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        return sum(
            (kind is None or e.kind == kind) and (phase is None or e.phase == phase) for e in self.events
        )

    def report(self) -> str:
        return "\n".join(f"{e.kind:5s} {e.op:22s} in {e.phase:18s} at {e.where}" for e in self.events)

    # ---- the mode ----------------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in READS:
            src = args[0]
            if on_device(src):
                self._record("read", func)
                out = func(*args, **kwargs)
                # the host copy is a new host tensor (on a CPU .cpu() returns the tensor itself)
                return out.clone() if isinstance(out, torch.Tensor) else out
            return func(*args, **kwargs)
        if func in COPIES:
            device = kwargs.get("device")
            if device is None or _is_host(device):
                return func(*args, **kwargs)
            if not on_device(args[0] if args else None):
                self._record("copy", func)
            return _tag(func(*args, **kwargs))
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            return self._to(func, args, kwargs)
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        flat = tree_flatten((args, kwargs))[0]
        if (device is not None and not _is_host(device)) or any(on_device(t) for t in flat):
            _tag(out)
        return out

    def _to(self, func: Any, args: tuple, kwargs: dict) -> Any:
        src = args[0]
        target = "device" if func is torch.Tensor.cuda else _target_device(args, kwargs)
        out = func(*args, **kwargs)
        if target is None:  # a dtype change: placement unchanged
            return _tag(out) if on_device(src) else out
        if _is_host(target):
            if on_device(src):
                self._record("read", func)
                return out.clone()
            return out
        if on_device(src):
            return _tag(out)
        if not kwargs.get("non_blocking", False):
            self._record("copy", func)
        if out is src:  # on a CPU .to(device) returns the host tensor itself
            out = out.clone()
        return _tag(out)
