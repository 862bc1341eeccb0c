"""Pieces of the service and its operations, in process: error bodies, the socket directory, the
host-memory check, the progress log."""

import logging
import os

import pytest

from ckpt_core.errors import ConfigError, RemoteWorkerError
from ckpt_core.planning.capacity import check_host_memory, host_memory_available

fastapi = pytest.importorskip("fastapi")
from ckpt_core.service._runner import default_socket_dir  # noqa: E402
from ckpt_core.service._state import MAX_MESSAGE_CHARS, MAX_TRACEBACK_CHARS, error_fields, status_of  # noqa: E402
from ckpt_core.ops.progress import LogProgress  # noqa: E402


def test_a_remote_traceback_appears_once_in_the_error_body():
    exc = RemoteWorkerError("engine failed", rank=1, remote_traceback="Traceback (most recent call last):\n  boom")
    body = error_fields(exc)
    assert body["message"] == "[rank 1] engine failed" and body["rank"] == 1
    assert body["remote_traceback"].count("boom") == 1 and "boom" not in body["message"]


def test_error_bodies_are_bounded():
    body = error_fields(ConfigError("x" * 10_000_000))
    assert len(body["message"]) < MAX_MESSAGE_CHARS + 100 and "more characters cut" in body["message"]
    body = error_fields(RemoteWorkerError("e", remote_traceback="t" * 10_000_000))
    assert len(body["remote_traceback"]) < MAX_TRACEBACK_CHARS + 100


@pytest.mark.parametrize("exc, code", [(ConfigError("x"), 400), (KeyError("x"), 500),
                                       (RemoteWorkerError("x"), 502)])
def test_status_codes_separate_client_mistakes_from_failures(exc, code):
    assert status_of(exc) == code


def test_the_default_socket_directory_is_created_private_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = default_socket_dir()
    assert d == str(tmp_path / "ckpt-engine") and (os.stat(d).st_mode & 0o777) == 0o700
    assert default_socket_dir() == d, "an existing private directory is reused"
    os.chmod(d, 0o755)
    with pytest.raises(ConfigError, match="mode 0700"):
        default_socket_dir()
    os.rmdir(d)
    os.symlink(tmp_path, d)
    with pytest.raises(ConfigError, match="not a directory of this user"):
        default_socket_dir()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_dir() == f"/tmp/ckpt-engine-{os.getuid()}"


def test_the_host_memory_check_names_both_sizes_and_passes_when_it_fits_or_is_unknown():
    check_host_memory(1 << 30, 2 << 30)
    check_host_memory(1 << 40, None)
    with pytest.raises(ConfigError, match=r"needs 4.00 GiB of new host memory but only 1.00 GiB"):
        check_host_memory(4 << 30, 1 << 30)


def test_host_memory_available_takes_the_lower_of_meminfo_and_the_cgroups_room(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    8388608 kB\n")   # 8 GiB
    cg = tmp_path / "cg"
    cg.mkdir()
    assert host_memory_available(str(tmp_path / "meminfo"), str(cg)) == 8 << 30
    (cg / "memory.max").write_text(f"{6 << 30}\n")
    (cg / "memory.current").write_text(f"{3 << 30}\n")
    (cg / "memory.stat").write_text(f"anon 100\ninactive_file {1 << 30}\n")
    assert host_memory_available(str(tmp_path / "meminfo"), str(cg)) == 4 << 30
    (cg / "memory.max").write_text("max\n")
    assert host_memory_available(str(tmp_path / "meminfo"), str(cg)) == 8 << 30
    assert host_memory_available(str(tmp_path / "none"), str(tmp_path / "none")) is None


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_progress_log_says_when_an_operation_starts_and_then_every_period(caplog):
    clock = Clock()
    p = LogProgress("ps rank 0/2", every_s=10, describe=lambda op: ("step-7", 1234), clock=clock)
    with caplog.at_level(logging.INFO, logger="ckpt_core"):
        p("update", "plan", None, None)
        p("update", "handshake", 0, 8)
        clock.t += 5
        p("update", "transfer", 2, 8)   # within the period: no line
        clock.t += 6
        p("update", "transfer", 5, 8)
        p("update", "post-hook", 8, 8)
        p("update", "plan", None, None)   # the next update starts: a new start line
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "[ps rank 0/2] phase=update checkpoint=step-7 outcome=started bytes=1234"
    assert lines[1] == "[ps rank 0/2] phase=update step=transfer progress 5/8 buckets elapsed_s=11.0"
    assert lines[2].endswith("outcome=started bytes=1234") and len(lines) == 3, lines


def test_the_progress_log_can_keep_to_start_lines_only(caplog):
    clock = Clock()
    p = LogProgress("r", every_s=0, clock=clock)
    with caplog.at_level(logging.INFO, logger="ckpt_core"):
        p("register", "validate", None, None)
        clock.t += 1000
        p("register", "fill", 10, 100)
    assert [r.getMessage() for r in caplog.records] == ["[r] phase=register checkpoint=None outcome=started bytes=-"]


@pytest.mark.parametrize("body, message", [
    ({"stage": "v8"}, "stage needs an update_url"),
    ({"engine": "sglang", "update_url": "http://127.0.0.1:1", "stage": "v8", "weight_version": "v8"},
     "a staged update's version is stage"),
    ({"stage_device_gib": 1}, "stage_device_gib applies to a staged update"),
    ({"prepare": True}, "prepare applies to a staged update"),
    ({"prepare": True, "stage": "v1", "update_url": "http://127.0.0.1:1/", "engine": "sglang"},
     "prepare does not apply to engine='sglang'"),
    ({"engine": "sglang", "update_url": "http://127.0.0.1:1", "stage": "v8", "flush_cache": False},
     "flush_cache applies to a whole update"),
    ({"engine": "trtllm"}, "unknown engine 'trtllm'; known engines: .*'sglang', 'vllm'"),
    ({"deltas": True, "stage": "v1", "prepare": True, "update_url": "http://127.0.0.1:1/collective_rpc"},
     "prepare does not apply to a staged delta"),
    ({"deltas": True, "engine": "sglang", "update_url": "http://127.0.0.1:1"}, "deltas does not apply to engine='sglang'"),
    ({"delta": "sometimes"}, "delta"),
])
def test_a_staged_update_request_that_cannot_work_is_refused(body, message):
    from pydantic import ValidationError

    from ckpt_core.service._models import UpdateRequest

    with pytest.raises(ValidationError, match=message):
        UpdateRequest(**body)
    assert UpdateRequest(engine="sglang", update_url="http://127.0.0.1:1", stage="v8").stage == "v8"


def test_a_commit_pauses_the_way_its_engine_can():
    from pydantic import ValidationError

    from ckpt_core.service._models import CommitRequest

    url = "http://127.0.0.1:1"
    assert CommitRequest(update_url=url, version="v").pause == "keep"
    assert CommitRequest(update_url=url, version="v", engine="sglang").pause == "retract"
    for engine, pause in (("sglang", "keep"), ("vllm", "retract")):
        with pytest.raises(ValidationError, match=f"a {engine} commit pauses with one of"):
            CommitRequest(update_url=url, version="v", engine=engine, pause=pause)


def test_a_delta_request_reaches_the_ps_and_tells_the_vllm_workers_its_version():
    from pydantic import ValidationError

    from ckpt_core.service._models import RegisterRequest, UpdateRequest
    from ckpt_core.service._policy import ServicePolicy
    from ckpt_core.service._update import _engine_request

    assert RegisterRequest(files=["/x.safetensors"], base="step-7").base == "step-7"
    with pytest.raises(ValidationError, match="base"):
        RegisterRequest(files=["/x.safetensors"], base="a/b")
    assert UpdateRequest(delta="fallback").delta == "fallback" and UpdateRequest(delta=True).delta is True
    url = "http://127.0.0.1:9/collective_rpc"
    for body, want in ((UpdateRequest(update_url=url, delta=True), {"deltas": True, "version": "step-8"}),
                       (UpdateRequest(update_url=url, deltas=True), {"deltas": True, "version": "step-8"}),
                       (UpdateRequest(update_url=url), {})):
        request = _engine_request(body, 1, "native", ServicePolicy(), "step-8")
        seen = []
        request.engine.update = lambda handles, **options: seen.append(options)
        request([("dev0", "ipc://h0")])
        assert seen == [want]
    # staged: the stage's version is the checkpoint's name (what the workers hold after the commit, the next base)
    for body in (UpdateRequest(update_url=url, delta=True, stage="v8"), UpdateRequest(update_url=url, deltas=True, stage="v8")):
        request = _engine_request(body, 1, "native", ServicePolicy(), "v8")
        staged = []
        request.engine.stage = lambda handles, version, **options: staged.append((version, options))
        request([("dev0", "ipc://h0")])
        assert staged == [("v8", {"device_bytes": 0, "deltas": True})]
    with pytest.raises(ConfigError, match="give stage='v8', not 'v7'"):
        _engine_request(UpdateRequest(update_url=url, delta=True, stage="v7"), 1, "native", ServicePolicy(), "v8")
    with pytest.raises(ConfigError, match="prepare does not apply to a staged delta"):
        _engine_request(UpdateRequest(update_url=url, delta=True, stage="v8", prepare=True), 1, "native",
                        ServicePolicy(), "v8")


def test_the_vllm_client_refuses_deltas_without_a_version_before_posting():
    from ckpt_vllm import VllmClient

    with VllmClient("http://127.0.0.1:9") as client:   # nothing listens: a refusal must come first
        for kwargs in ({}, {"version": "v2", "path": "backend"}):
            with pytest.raises(ConfigError, match="deltas=True takes the extension path and needs version="):
                client.update([("dev0", "ipc://h0")], deltas=True, **kwargs)


def test_metrics_count_updates_by_kind_and_the_bytes_deltas_save():
    pytest.importorskip("prometheus_client")
    from ckpt_core.ops.metrics import Metrics

    m = Metrics(3)
    m.succeeded("update", 0.1, 100, {"name": "A", "h2d_bytes": 1000})
    m.succeeded("update", 0.1, 100, {"name": "B", "h2d_bytes": 40, "delta": {"base": "A", "payload_bytes": 40,
                                                                            "full_bytes": 1000}})
    m.succeeded("update", 0.1, 100, {"name": "C", "h2d_bytes": 1000, "delta": {"fallback": "not its base"}})
    text = m.render().decode()
    for kind in ("full", "delta", "fallback"):
        assert f'ckpt_updates_by_kind_total{{kind="{kind}",rank="3"}} 1.0' in text
    assert 'ckpt_delta_payload_bytes_total{rank="3"} 40.0' in text
    assert 'ckpt_delta_full_bytes_total{rank="3"} 1000.0' in text
