"""Engines are found by name, as device kinds are: the entry-point group ``ckpt_core.engines`` (and the
source tree's pyproject.toml, since the project runs from PYTHONPATH), nothing imported until asked;
a third-party engine is served by name with no core edit; each first-party engine validates its own
options."""

import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_core.engines import registry
from ckpt_core.engines.base import EngineClient, Requester, UpdateReport, check_option_names
from ckpt_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def engines(monkeypatch):
    """The registry, restored after the test (registrations are process-wide)."""
    registry.available_engines()   # names collected first, so that the copies hold them
    monkeypatch.setattr(registry, "_factories", dict(registry._factories))
    monkeypatch.setattr(registry, "_instances", dict(registry._instances))
    return registry


def test_vllm_and_sglang_are_found_by_name_without_importing_either():
    code = ("import sys; from ckpt_core.engines import available_engines as a; names = a(); "
            "print(names, sorted(m for m in sys.modules if m.split('.')[0] in ('ckpt_vllm', 'ckpt_sglang')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names, imported = out.stdout.strip().split("] [")
    assert {"'sglang'", "'vllm'"} <= set(names.strip("[").split(", ")) and imported == "]", out.stdout


def test_the_source_tree_declares_the_engines_an_install_would_register(tmp_path):
    found = {ep.name: ep.value for ep in registry.source_tree_entry_points(ROOT)}
    assert found == {"vllm": "ckpt_vllm.engine:VllmEngine", "sglang": "ckpt_sglang.engine:SglangEngine"}
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n[project.entry-points."ckpt_core.engines"]\n'
                                             'x = "x:X"\n')
    assert registry.source_tree_entry_points(tmp_path) == [], "only ckpt-engine's own tree is read"
    assert registry.source_tree_entry_points(tmp_path / "missing") == []


@pytest.mark.parametrize("name, routes, default_pause", [("vllm", ("/collective_rpc",), "keep"),
                                                         ("sglang", ("", "/update_weights_from_ipc"), "retract")])
def test_each_first_party_engine_gives_its_routes_pauses_and_a_client(name, routes, default_pause):
    kind = registry.get_engine(name)
    assert kind.name == name and kind.routes == routes and kind.commit_pauses[0] == default_pause
    url = f"http://127.0.0.1:1{routes[-1]}"
    with kind.client(url, uds=None, timeout=5.0) as client:
        assert isinstance(client, EngineClient) and isinstance(client, Requester)
        assert client.endpoint == "http://127.0.0.1:1", "the client talks to the server's base URL"
    assert registry.get_engine(name) is kind, "one instance per process"


@pytest.mark.parametrize("name, given, staged, message", [
    ("vllm", {"weight_version": "v1"}, False, "weight_version does not apply to engine='vllm'"),
    ("vllm", {"prepare": True}, False, "prepare applies to a staged update"),
    ("vllm", {"direct": True}, True, "direct applies to a plain full update"),
    ("vllm", {"direct": True, "slices": True}, False, "direct applies to a plain full update"),
    ("vllm", {"direct": True, "deltas": True}, False, "direct applies to a plain full update"),
    ("sglang", {"slices": True}, False, "slices does not apply to engine='sglang'"),
    ("sglang", {"weight_version": "v"}, True, "a staged update's version is stage"),
    ("sglang", {"flush_cache": False}, True, "flush_cache applies to a whole update"),
])
def test_an_engine_refuses_an_option_it_does_not_take_naming_it(name, given, staged, message):
    with pytest.raises(ConfigError, match=message):
        registry.get_engine(name).check_options(given, staged=staged)


def test_an_engine_takes_its_own_options():
    registry.get_engine("vllm").check_options({"prepare": True, "slices": True}, staged=True)
    registry.get_engine("vllm").check_options({"direct": True}, staged=False)
    registry.get_engine("sglang").check_options({"weight_version": "7", "flush_cache": False}, staged=False)
    with pytest.raises(ConfigError, match="stock wire"):
        registry.get_engine("sglang").check_wire("native")
    registry.get_engine("vllm").check_wire("stock")


class FakeClient(Requester):
    def update(self, handles, **options):
        return UpdateReport(path="fake", workers=[dict(handles)])

    def stage(self, handles, version, *, timeout=None, device_bytes=0, **options):
        return UpdateReport(path="stage")

    def commit(self, version, *, pause, timeout=None):
        return UpdateReport(path=f"commit {pause}")


class FakeEngine:
    name = "fake"
    routes = ("/load",)
    commit_pauses = ("hold",)
    options = ("speed",)

    def check_options(self, given, *, staged):
        check_option_names(self, given)

    def check_wire(self, wire):
        pass

    def client(self, update_url, *, uds=None, timeout=600.0):
        return FakeClient(update_url.removesuffix("/load"), uds=uds, timeout=timeout)


def test_a_third_party_engine_is_served_by_name_with_no_core_edit(engines):
    pytest.importorskip("fastapi")
    from ckpt_core.service._models import CommitRequest, UpdateRequest
    from ckpt_core.service._policy import Forbidden, ServicePolicy

    engines.register_engine("fake", FakeEngine)
    assert "fake" in engines.available_engines()
    assert "fake" in UpdateRequest.model_json_schema()["properties"]["engine"]["enum"]
    body = UpdateRequest(engine="fake", update_url="http://127.0.0.1:9/load")
    assert ServicePolicy().check_engine(body.update_url, None, "fake") is None
    with pytest.raises(Forbidden, match="route"):
        ServicePolicy().check_engine("http://127.0.0.1:9/collective_rpc", None, "fake")
    assert CommitRequest(engine="fake", update_url="http://127.0.0.1:9/load", version="v").pause == "hold"
    with pytest.raises(ValueError, match="prepare does not apply to engine='fake'"):
        UpdateRequest(engine="fake", update_url="http://127.0.0.1:9/load", prepare=True, stage="v")


def test_an_unknown_or_misnamed_or_broken_engine_is_a_config_error_naming_it(engines):
    with pytest.raises(ConfigError, match=r"unknown engine 'trtllm'; known engines: \[.*'sglang', 'vllm'"):
        engines.get_engine("trtllm")
    engines.register_engine("other", FakeEngine)
    with pytest.raises(ConfigError, match="registered as 'other' reports the name 'fake'"):
        engines.get_engine("other")
    from importlib.metadata import EntryPoint
    broken = EntryPoint("broken", "no_such_pkg.engine:E", "ckpt_core.engines")
    engines.register_engine("broken", engines._loader(broken))
    with pytest.raises(ConfigError, match=r"engine 'broken' \(no_such_pkg.engine:E.*could not be loaded: "
                                          "ModuleNotFoundError"):
        engines.get_engine("broken")


def test_a_third_party_engines_own_options_reach_its_client_and_others_are_refused(engines):
    pytest.importorskip("fastapi")
    from ckpt_core.service._models import UpdateRequest
    from ckpt_core.service._policy import ServicePolicy
    from ckpt_core.service._update import _engine_request

    engines.register_engine("fake", FakeEngine)
    url = "http://127.0.0.1:9/load"
    body = UpdateRequest(engine="fake", update_url=url, options={"speed": 3})
    req_func = _engine_request(body, 1, "native", ServicePolicy())
    client = req_func.engine
    seen = []
    client.update = lambda handles, **options: seen.append((handles, options))
    assert req_func([("dev0", "ipc://h0")]) is None and seen == [([("dev0", "ipc://h0")], {"speed": 3})]
    assert client.http._closed, "req_func closed its client"
    with pytest.raises(ValueError, match="color does not apply to engine='fake' \\(its options: speed\\)"):
        UpdateRequest(engine="fake", update_url=url, options={"color": "red"})
    with pytest.raises(ValueError, match="slices in options: give them as fields of the request"):
        UpdateRequest(update_url=url, options={"slices": True})
