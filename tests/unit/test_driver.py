"""The reference launchers' flow shared by our drivers (ckpt_core/engines/driver.py): which updates run, in order."""

from __future__ import annotations

import pytest

from ckpt_core.engines.driver import run_updates, update_methods
from ckpt_core.errors import ConfigError


@pytest.mark.parametrize("method, joining, want", [
    ("broadcast", False, ["broadcast"]), ("p2p", False, ["p2p"]), ("all", False, ["broadcast", "p2p"]),
    ("broadcast", True, ["p2p"]), ("all", True, ["p2p"]),   # a joiner owns nothing: it can only pull
])
def test_update_methods_expand_in_the_reference_order(method, joining, want):
    assert update_methods(method, joining) == want


def test_an_unknown_update_method_is_a_config_error():
    with pytest.raises(ConfigError, match="--update-method must be one of"):
        update_methods("multicast", False)


class _RecordingPs:
    world_size = 3

    def __init__(self):
        self.calls = []

    def update(self, name, req_func, *, ranks, timeout):
        req_func(["h0", "h1", "h2"])
        self.calls.append((name, ranks, timeout))
        return {"n": len(self.calls)}


def test_run_updates_broadcasts_then_pulls_into_every_rank_and_yields_after_each():
    ps, seen = _RecordingPs(), []

    def make(reports):
        return lambda handles: reports.append(len(handles))

    for method, result, reports in run_updates(ps, "c", ["broadcast", "p2p"], make, timeout=5.0):
        seen.append((method, result, reports, len(ps.calls)))
    assert ps.calls == [("c", None, 5.0), ("c", [0, 1, 2], 5.0)]
    assert seen == [("broadcast", {"n": 1}, [3], 1), ("p2p", {"n": 2}, [3], 2)], "yielded as each update ends"
