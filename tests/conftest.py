import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CPU_MASK_ENV = "BERT_MP_CPU_MASK"  # bert_mp.precision.CPU_MASK_ENV (not imported here: see below)


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-mask",
        default=None,
        help="run as on a weaker CPU: comma-separated subset of amx,fp16,bf16 or 'all' "
        f"(sets {CPU_MASK_ENV}, inherited by the CLI processes the tests start)",
    )


def pytest_configure(config):
    # Set before bert_mp is imported, so its oneDNN ISA cap applies from the first kernel on.
    mask = config.getoption("--cpu-mask")
    if mask is not None:
        os.environ[CPU_MASK_ENV] = mask


def pytest_report_header(config):
    from bert_mp.core.precision import cpu_capabilities

    caps = cpu_capabilities().as_dict()
    return (
        f"bert_mp CPU capabilities: bf16={caps['bf16']} fp16={caps['fp16']} amx={caps['amx']} "
        f"masked={','.join(caps['masked']) or 'none'} "
        f"(ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')})"
    )


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each test starts and ends with them reset."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
