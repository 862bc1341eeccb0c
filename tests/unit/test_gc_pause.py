import gc
import threading

import pytest

from ckpt_core.ops.gc import gc_paused
from ckpt_core.errors import ConfigError


def test_the_collector_is_paused_inside_and_resumes_after_the_outermost_block():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "an inner block must not resume the collector"
    assert gc.isenabled()


def test_an_exception_still_resumes_the_collector():
    with pytest.raises(KeyError):
        with gc_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_the_application_disabled_stays_disabled():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_concurrent_pauses_resume_only_when_the_last_ends():
    inside, release = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled(), "the other thread's pause is still running"
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_ps_pause_gc_0_leaves_the_collector_running_and_bad_values_are_config_errors(monkeypatch):
    monkeypatch.setenv("PS_PAUSE_GC", "0")
    with gc_paused():
        assert gc.isenabled()
    monkeypatch.setenv("PS_PAUSE_GC", "maybe")
    with pytest.raises(ConfigError, match="PS_PAUSE_GC"):
        with gc_paused():
            pass
    assert gc.isenabled()
