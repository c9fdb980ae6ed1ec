"""Threads default to ``cores // local processes``; the start-up line and the recorded conditions."""

import torch

from bert_mp.core.process import conditions as c


def test_default_threads_share_the_cores_between_local_processes():
    assert c.default_threads(16, 1) == 16
    assert c.default_threads(16, 2) == 8
    assert c.default_threads(2, 2) == 1
    assert c.default_threads(2, 4) == 1  # at least one


def test_apply_default_threads_respects_the_environment(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setattr(c, "usable_cores", lambda: 4)
        choice = c.apply_default_threads()
        assert (choice.threads, choice.source) == (2, "4 cores // 2 processes")
        assert torch.get_num_threads() == 2 and c.current_threads() == choice

        torch.set_num_threads(1)  # a Python caller's own choice is reported as such
        assert c.current_threads().source == "set in this process"

        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's (or the launcher's) choice wins
        choice = c.apply_default_threads()
        assert choice.source == "OMP_NUM_THREADS=1" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        c._CHOSEN.clear()


def test_startup_line_names_processes_threads_accumulation_precision_device():
    line = c.startup_line(
        "train",
        processes=2,
        threads=c.ThreadChoice(1, "2 cores // 2 processes"),
        accumulation=4,
        precision="bf16",
        device="cpu (Test CPU)",
    )
    assert line == (
        "bert-mp train: 2 processes x 1 thread (2 cores // 2 processes), accumulation 4, "
        "precision bf16, device cpu (Test CPU)"
    )


def test_load_warning_only_when_the_load_exceeds_the_cores(monkeypatch):
    monkeypatch.delenv(c.LOAD_WARNING_ENV, raising=False)
    assert c.load_warning([1.9, 1.0, 1.0], 2) is None
    assert c.load_warning([2.0, 1.0, 1.0], 2) is None  # equal to the cores: not above them
    assert c.load_warning(None, 2) is None
    w = c.load_warning([3.2, 1.0, 1.0], 2)
    monkeypatch.setenv(c.LOAD_WARNING_ENV, "0")
    assert c.load_warning([3.2, 1.0, 1.0], 2) is None
    monkeypatch.delenv(c.LOAD_WARNING_ENV)
    assert "3.20" in w and "2 cores" in w


def test_load_warning_wording_names_the_run_not_one_process(monkeypatch):
    """A load just above the cores shows as above them (2.01, not a rounded 2.0), and the cores are
    those of the run, whose processes and threads are counted as they are."""
    monkeypatch.delenv(c.LOAD_WARNING_ENV, raising=False)
    assert c.load_warning([2.01, 1.0, 1.0], 2, processes=2, threads=1) == (
        "the load average over the last minute is 2.01, above the 2 cores this run may use "
        "(2 processes x 1 thread): other work has been sharing the machine, so this run may be slower than the "
        "machine allows and its timings may not compare with an idle machine's (summary.json records the load it "
        "meets while it runs)"
    )
    assert "(1 process x 2 threads)" in c.load_warning([4.5, 1.0, 1.0], 2, processes=1, threads=2)


def test_conditions_record_threads_load_and_other_processes():
    cond = c.Conditions.at_start(processes=1)
    d = cond.at_end()
    assert d["threads"] == torch.get_num_threads() and d["processes"] == 1
    assert d["cores"] >= 1 and d["cpu_model"]
    assert set(d) >= {"load_start", "load_end", "others_cpu_cores", "thread_env", "gpu"}
    if d["load_start"] is not None:
        assert len(d["load_start"]) == 3


def test_announce_start_prints_one_line_on_the_main_process_and_warns_when_loaded(monkeypatch, capsys):
    from types import SimpleNamespace

    plan = SimpleNamespace(name="bf16", emulated=True)
    monkeypatch.delenv(c.LOAD_WARNING_ENV, raising=False)
    monkeypatch.setattr(c, "load_average", lambda: [99.0, 1.0, 1.0])
    main = SimpleNamespace(num_processes=2, is_main_process=True, device=torch.device("cpu"))
    cond = c.announce_start(main, "train", 3, plan)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("bert-mp train: 2 processes x ")
    assert "accumulation 3, precision bf16 (emulated), device cpu (" in lines[0]
    assert lines[1].startswith(
        "bert-mp train: warning: the load average over the last minute is 99.00, above"
    )
    assert cond.load_start == [99.0, 1.0, 1.0] and cond.processes == 2
    other = SimpleNamespace(num_processes=2, is_main_process=False, device=torch.device("cpu"))
    c.announce_start(other, "train", 3, plan)
    assert capsys.readouterr().out == ""  # every other rank stays silent


def test_the_start_up_line_says_where_subnormals_are_flushed():
    args = dict(
        processes=1,
        threads=c.ThreadChoice(2, "2 cores // 1 process"),
        accumulation=1,
        precision="fp32",
        device="cpu (Test CPU)",
    )
    plain = c.startup_line("train", **args)
    assert c.startup_line("train", **args, flush_denormal="off") == plain
    assert c.startup_line("train", **args, flush_denormal="on") == plain + ", subnormals flushed to zero"
    assert c.startup_line("train", **args, flush_denormal="partial").endswith("flushed on some threads only")


def test_conditions_record_the_flush_and_the_subnormal_share_of_the_state():
    from bert_mp.core.numerics.subnormal import EFFECTS

    cond = c.Conditions.at_start(processes=1)
    assert cond.flush_denormal in EFFECTS
    state = [torch.tensor([1, 0x3F800000, 0, 2], dtype=torch.int32).view(torch.float32)]
    d = cond.at_end(state)
    assert d["subnormal_share"] == 0.5 and d["flush_denormal"] == cond.flush_denormal
