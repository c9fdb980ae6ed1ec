import os
import signal

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the loaded-machine warning adds a line to a command's output only when the machine is busy: off
# for the suite (tests/unit/core/test_conditions.py turns it on where it tests it)
os.environ.setdefault("BERT_MP_LOAD_WARNING", "0")
# Idle OpenMP threads sleep instead of spinning (read when torch loads libgomp, so set before any
# import of torch; the CLI processes the tests start inherit it). The thread count, the split of the
# work and so every number stay the same; a spinning thread on a busy machine only takes a core from
# the thread that has work: tiny matmuls ran ~10-100x slower in wall time on a loaded 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A suite started as a background job of a shell without job control (or under some CI runners)
# inherits SIGINT and SIGQUIT as *ignored*, and an ignored signal stays ignored in every process the
# tests start: their Ctrl-C would never land and a held run would wait for it forever. A handler
# here is reset to the default in each child at exec, so the commands under test see a normal Ctrl-C.
for _sig, _handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL)):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, _handler)

CPU_MASK_ENV = "BERT_MP_CPU_MASK"  # numerics.precision.CPU_MASK_ENV (not imported here: see below)
FRESH_ENV = "BERT_MP_TEST_FRESH"
"""``1`` (scripts/test.sh's full run, so every CI run): the tests marked ``signals`` (every test that acts
on a running process) or ``fresh`` (the README's commands) start their commands as fresh processes,
never through the fork server (tests/forkserver.py): what the server's imports would hide - a missing
import, an import-order or start-up bug - fails there, in the commands a user runs first and in every
stop and kill."""


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-mask",
        default=None,
        help="run as on a weaker CPU: comma-separated subset of amx,fp16,bf16 or 'all' "
        f"(sets {CPU_MASK_ENV}, inherited by the CLI processes the tests start)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", f"fresh: its commands run as fresh processes where {FRESH_ENV}=1")
    # Set before bert_mp is imported, so its oneDNN ISA cap applies from the first kernel on.
    mask = config.getoption("--cpu-mask")
    if mask is not None:
        os.environ[CPU_MASK_ENV] = mask


def pytest_report_header(config):
    from bert_mp.core.numerics.precision import cpu_capabilities

    caps = cpu_capabilities().as_dict()
    return (
        f"bert_mp CPU capabilities: bf16={caps['bf16']} fp16={caps['fp16']} amx={caps['amx']} "
        f"masked={','.join(caps['masked']) or 'none'} "
        f"(ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')})"
    )


TEST_TIMEOUT_ENV = "BERT_MP_TEST_TIMEOUT"
"""Seconds each test may take (setup, call, teardown), enforced with SIGALRM; unset or 0: no limit.
scripts/gpu/check.py sets it so one hung test cannot eat the GPU check's budget."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = float(os.environ.get(TEST_TIMEOUT_ENV) or 0)
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{item.nodeid} exceeded its {seconds:g} s budget ({TEST_TIMEOUT_ENV})")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------------------------------
# CPU seconds per test: the test process and every process it started and waited for (the commands
# under test, their launchers and ranks). Unlike wall time they hardly change with the machine's
# load, so the suite's cost can be read on a busy machine; the summary lists the dearest tests and
# the total. BERT_MP_TEST_CPU_REPORT=<file> also writes every test's seconds there as JSON
# (scripts/test.sh writes its masked rerun's beside it, as <file minus .json>.masked.json).
# --------------------------------------------------------------------------------------------------
CPU_REPORT_ENV = "BERT_MP_TEST_CPU_REPORT"


def _cpu_seconds() -> float:
    import resource
    import sys

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = getattr(sys.modules.get("forkserver"), "CPU_SECONDS", 0.0)  # commands a fork server ran
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_seconds", _cpu_seconds() - start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_seconds", _cpu_seconds() - start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_seconds", _cpu_seconds() - start))


_CPU_BY_TEST: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # user_properties accumulate over the phases: the last report of a test carries all of them
    phases = [v for k, v in report.user_properties if k == "cpu_seconds"]
    if phases:
        _CPU_BY_TEST[report.nodeid] = sum(phases)


def pytest_sessionfinish(session):
    import sys

    if "forkserver" in sys.modules:
        sys.modules["forkserver"].close_servers()


def pytest_terminal_summary(terminalreporter):
    if not _CPU_BY_TEST or hasattr(terminalreporter.config, "workerinput"):
        return
    total = sum(_CPU_BY_TEST.values())
    files: dict[str, float] = {}
    for nodeid, seconds in _CPU_BY_TEST.items():
        files[nodeid.split("::", 1)[0]] = files.get(nodeid.split("::", 1)[0], 0.0) + seconds
    tr = terminalreporter
    tr.section(f"CPU seconds (test process + the processes it started): {total:.0f} in all")
    for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:10]:
        tr.write_line(f"{seconds:8.1f}  {100 * seconds / total:4.1f}%  {name}")
    out = os.environ.get(CPU_REPORT_ENV)
    if out:
        import json

        with open(out, "w", encoding="utf-8") as f:
            json.dump({"total_cpu_seconds": total, "tests": _CPU_BY_TEST}, f, indent=1, sort_keys=True)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each test starts and ends with them reset."""
    from support import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()


def commands_fresh(node) -> bool:
    """Whether the test ``node`` starts its commands fresh: marked ``signals`` or ``fresh``, in a run
    with ``BERT_MP_TEST_FRESH=1``."""
    marked = node.get_closest_marker("signals") or node.get_closest_marker("fresh")
    return bool(marked) and os.environ.get(FRESH_ENV) == "1"


@pytest.fixture(autouse=True)
def fresh_commands(request, monkeypatch):
    if commands_fresh(request.node):
        monkeypatch.setenv("BERT_MP_TEST_FORKSERVER", "0")  # forkserver.SWITCH_ENV, read at each command
    yield


@pytest.fixture(autouse=True)
def no_held_session_left():
    """Commands a test started in their own session (support.own_session) end with the test."""
    yield
    from support import end_own_sessions

    end_own_sessions()


# --------------------------------------------------------------------------------------------------
# data and checkpoints more than one test file uses (module scope: built once per file). The
# helpers are in support.py, imported here lazily: bert_mp must not be imported before
# pytest_configure has applied --cpu-mask. A file's own fixture of the same name wins over these
# (unit/data/test_prepare.py's `prepared` is real bert-mp prepare output, loaded).
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared-data folder (support.make_prepared, 64 training rows); its path."""
    from support import make_prepared

    root = tmp_path_factory.mktemp("prepared")
    make_prepared(root, n_train=64)
    return root


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A folder with support.fixed_tokenizer saved in it."""
    from support import fixed_tokenizer

    return fixed_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok():
    """The fine-tuning tokenizer: the words of support.FINETUNE_WORDS and numbers."""
    from support import FINETUNE_WORDS, finetune_tokenizer

    return finetune_tokenizer([" ".join(FINETUNE_WORDS)] * 20 + [f"number {i}" for i in range(50)])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tok):
    """A tiny pretrained checkpoint (support.make_checkpoint) to fine-tune from."""
    from support import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "final", tok)
