import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each test starts and ends with them reset."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


_EMULATION_STARTUP = """\
import bert_mp.core.precision as _precision

_precision._cpu_supports_bf16 = lambda: True
_precision._cpu_supports_fp16 = lambda: True
"""


@pytest.fixture
def emulate_precision(monkeypatch, tmp_path_factory):
    """Run bf16/fp16 on a CPU without native support (torch's CPU autocast emulates them).

    The one place where tests force emulated precision: in this process, and in the subprocesses a
    test starts (a ``sitecustomize`` on PYTHONPATH applies the same patch at interpreter start).
    """
    import bert_mp.core.precision as precision

    monkeypatch.setattr(precision, "_cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(precision, "_cpu_supports_fp16", lambda: True)
    startup = tmp_path_factory.mktemp("emulate_precision")
    (startup / "sitecustomize.py").write_text(_EMULATION_STARTUP)
    path = os.pathsep.join(p for p in (str(startup), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
