"""prepare's glibc malloc settings: applied on glibc, left alone where the user set their own,
and never a change to what prepare writes (the golden prepare digests run under them)."""

from __future__ import annotations

import platform

import pytest

from bert_mp.data import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_available_on_glibc_only(monkeypatch):
    for var in allocator._USER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert allocator.available() == GLIBC


@pytest.mark.parametrize("var", allocator._USER_VARS)
def test_user_malloc_options_are_left_alone(monkeypatch, var):
    monkeypatch.setenv(var, "65536" if var.startswith("MALLOC") else "glibc.malloc.trim_threshold=65536")
    assert not allocator.available()
    with allocator.tuned() as applied:
        assert applied is False


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_tuned_applies_and_settles(monkeypatch):
    for var in allocator._USER_VARS:
        monkeypatch.delenv(var, raising=False)
    calls = []
    real = allocator._set
    monkeypatch.setattr(
        allocator, "_set", lambda libc, settings: calls.append(settings) or real(libc, settings)
    )
    with allocator.tuned() as applied:
        assert applied is True
        big = bytearray(8 << 20)  # below the 32 MiB threshold: from the heap, and given back below
        del big
    assert calls == [allocator.TUNED, allocator.SETTLED]
    assert real(allocator._libc(), allocator.SETTLED)  # glibc takes every value (mallopt returns 1 for each)
