"""The service's allow-lists (pure): which files a request may name, which engine endpoints it may post to."""

import os

import pytest

from ckpt_core.errors import ConfigError
from ckpt_core.service._policy import Forbidden, ServicePolicy


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "other").mkdir()
    os.symlink(tmp_path / "other", tmp_path / "ckpt" / "out")
    return tmp_path


def test_files_resolve_inside_an_allowed_directory_or_are_forbidden(dirs):
    policy = ServicePolicy.build([str(dirs / "ckpt")])
    assert policy.check_files([str(dirs / "ckpt" / "a.safetensors")]) == [str(dirs / "ckpt" / "a.safetensors")]
    for bad in ("a.safetensors", str(dirs / "ckpt" / ".." / "other" / "a"), str(dirs / "ckpt" / "out" / "a"),
                str(dirs / "ckptx" / "a"), "/etc/shadow"):
        with pytest.raises(Forbidden, match="--allow-dir"):
            policy.check_files([bad])
    with pytest.raises(Forbidden, match="none given"):
        ServicePolicy().check_files([str(dirs / "ckpt" / "a")])


def test_allow_dirs_must_exist_and_be_absolute(dirs):
    for bad in ("relative", str(dirs / "missing")):
        with pytest.raises(ConfigError):
            ServicePolicy.build([bad])


@pytest.mark.parametrize("url, uds, engine, ok", [
    ("http://127.0.0.1:8000/collective_rpc", None, "vllm", True),
    ("http://localhost:8000/collective_rpc", None, "vllm", True),
    ("http://[::1]:8000/collective_rpc", None, "vllm", True),
    ("http://127.0.0.1:8000/collective_rpc/../admin", None, "vllm", False),
    ("http://127.0.0.1:8000/v1.43/containers/victim/kill", None, "vllm", False),
    ("http://10.1.2.3:8000/collective_rpc", None, "vllm", False),
    ("http://user:pw@127.0.0.1:8000/collective_rpc", None, "vllm", False),
    ("file:///etc/shadow", None, "vllm", False),
    ("http://localhost:19730", None, "sglang", True),
    ("http://localhost:19730/update_weights_from_ipc", None, "sglang", True),
    ("http://localhost:19730/shutdown", None, "sglang", False),
    ("http://localhost/collective_rpc", "/var/run/docker.sock", "vllm", False),
])
def test_by_default_an_update_posts_only_to_the_engine_route_of_a_loopback_host(url, uds, engine, ok):
    policy = ServicePolicy.build()
    if ok:
        assert policy.check_engine(url, uds, engine) is None
    else:
        with pytest.raises(ConfigError):
            policy.check_engine(url, uds, engine)


def test_configured_engines_replace_the_loopback_default_and_sockets_must_be_listed(tmp_path):
    sock = str(tmp_path / "engine.sock")
    policy = ServicePolicy.build(engine_urls=["http://10.1.2.3:8000"], engine_uds=[sock])
    assert policy.check_engine("http://10.1.2.3:8000/collective_rpc", None, "vllm") is None
    for url in ("http://127.0.0.1:8000/collective_rpc", "http://10.1.2.3:8001/collective_rpc",
                "https://10.1.2.3:8000/collective_rpc"):
        with pytest.raises(Forbidden, match="--engine-url"):
            policy.check_engine(url, None, "vllm")
    assert policy.check_engine("http://ignored/collective_rpc", sock, "vllm") == sock
    with pytest.raises(Forbidden, match="route"):
        policy.check_engine("http://ignored/v1.43/containers/victim/kill", sock, "vllm")
    with pytest.raises(Forbidden, match="--engine-uds"):
        policy.check_engine("http://ignored/collective_rpc", str(tmp_path / "other.sock"), "vllm")
