"""Which address a P2P store publishes, where the rendezvous store listens, and who serves P2P
(issue 21, items 2, 5, 10): pure choices, tested on plain data."""

import pytest

from ckpt_core._settings import load_settings
from ckpt_core.engines.driver import serves_p2p
from ckpt_core.errors import ConfigError
from ckpt_core.planning.nics import choose_p2p_host, is_loopback, loopback_owners
from ckpt_core.transfer.collectives import store_bind_address


@pytest.mark.parametrize("explicit, to_master, outward, want", [
    ("10.0.0.9", "127.0.0.1", "10.0.0.5", "10.0.0.9"),    # PS_P2P_HOST wins, even over a better guess
    ("127.0.0.2", "10.0.0.5", None, "127.0.0.2"),         # ... and a loopback one set on purpose too
    ("", "10.0.0.5", "192.168.1.2", "10.0.0.5"),          # the route to MASTER_ADDR
    ("", "127.0.0.1", "10.0.0.5", "10.0.0.5"),            # torchrun --standalone: MASTER_ADDR=localhost
    ("", None, "10.0.0.5", "10.0.0.5"),                   # no route to MASTER_ADDR
    ("", "127.0.0.1", None, "127.0.0.1"),                 # nothing but loopback here
    ("", None, None, "127.0.0.1"),
])
def test_the_published_p2p_address_is_reachable_from_other_hosts_when_the_host_has_one(explicit, to_master, outward,
                                                                                        want):
    assert choose_p2p_host(explicit, to_master, outward) == want


@pytest.mark.parametrize("host, want", [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True),
                                        ("localhost", True), ("10.0.0.5", False), ("myhost", False), ("", False)])
def test_loopback_addresses_are_recognised(host, want):
    assert is_loopback(host) is want


def test_the_owners_that_publish_loopback_are_named():
    doc = {"checkpoints": {"c": {"owners": [
        {"rank": 0, "p2p": {"host": "10.0.0.5", "address": "10.0.0.5:15001"}},
        {"rank": 1, "p2p": {"host": "127.0.0.1", "address": "127.0.0.1:15002"}},
        {"rank": 2, "p2p": None}]}}}
    assert loopback_owners(doc) == [("c", 1, "127.0.0.1:15002")]


@pytest.mark.parametrize("master, world, local_world, want", [
    ("127.0.0.1", 4, None, "127.0.0.1"),   # peers can only be on this host
    ("localhost", 4, None, "127.0.0.1"),
    ("127.0.0.1", 1, 1, "127.0.0.1"),
    ("192.0.2.7", 1, None, "192.0.2.7"),   # one rank: the address its own client connects to
    ("192.0.2.7", 8, 8, "192.0.2.7"),      # torchrun: every rank on this host
    ("192.0.2.7", 16, 8, None),            # other hosts connect: every interface
])
def test_a_world_on_one_host_binds_its_rendezvous_store_to_one_address(master, world, local_world, want):
    assert store_bind_address(master, world, local_world) == want


@pytest.mark.parametrize("method, joining, save, want", [
    ("broadcast", False, None, False), ("p2p", False, None, True), ("all", False, None, True),
    ("broadcast", False, "m.json", True), ("p2p", True, None, False), ("all", True, "m.json", False)])
def test_launchers_serve_p2p_only_when_their_flags_ask_for_it(method, joining, save, want):
    assert serves_p2p(method, joining=joining, save_metas_file=save) is want


def test_p2p_serving_is_off_by_default_and_explicit_arguments_win(monkeypatch):
    monkeypatch.delenv("PS_P2P_SERVE", raising=False)
    assert load_settings().serve_p2p is False
    monkeypatch.setenv("PS_P2P_SERVE", "1")
    assert load_settings().serve_p2p is True
    assert load_settings(serve_p2p=False).serve_p2p is False
    monkeypatch.setenv("PS_P2P_SERVE", "maybe")
    with pytest.raises(ConfigError, match="PS_P2P_SERVE"):
        load_settings()
    with pytest.raises(ConfigError, match="serve_p2p"):
        load_settings(serve_p2p="yes")


def test_a_launcher_refuses_loopback_metas_on_every_rank_not_only_on_the_rank_that_writes_them(tmp_path):
    """Rank 0 alone failing would leave the others waiting in their first update."""
    from ckpt_core.engines.driver import prepare_checkpoint

    class FakePs:
        def __init__(self, rank):
            self.rank, self.saved = rank, []

        def register_checkpoint(self, name, files=None):
            pass

        def gather_metas(self, name):
            pass

        def check_metas_reachable(self):
            raise ConfigError("saving metas refused: ... set PS_P2P_HOST")

        def save_metas(self, path):
            self.saved.append(path)

    for rank in (0, 1):
        ps = FakePs(rank)
        with pytest.raises(ConfigError, match="PS_P2P_HOST"):
            prepare_checkpoint(ps, "c", files=[], load_metas_file=None, save_metas_file=str(tmp_path / "m.json"))
        assert ps.saved == []
