"""A rank's /v1/healthz turns 503 soon after a peer rank dies, without waiting for a collective to fail:
real 2-rank `ckpt-engine serve` worlds (gloo) on Unix sockets, one rank SIGKILLed."""

import os
import re
import signal
import time

import pytest

pytest.importorskip("fastapi")
from support.service_world import ServiceWorld  # noqa: E402

BEAT_S, PEER_TIMEOUT_S = 0.2, 2.0
CEILING_S = PEER_TIMEOUT_S + 8.0   # generous: the promise is "within the peer timeout", not seconds


def _world(tmp_path):
    return ServiceWorld(2, str(tmp_path), env={"CKPT_HEARTBEAT_S": str(BEAT_S),
                                               "CKPT_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)})


def _unhealthy_within(client, ceiling: float) -> tuple[float, dict]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < ceiling:
        resp = client.get("/v1/healthz")
        if resp.status_code == 503:
            return time.monotonic() - t0, resp.json()
        time.sleep(0.1)
    raise AssertionError(f"healthz still 200 {ceiling:.0f} s after the peer died")


def _silence_s(status: dict, killed: int) -> float:
    """How long the survivor has heard nothing: the dead peer's beat age, or (rank 0 killed) how long its
    rendezvous store has not answered, as the problem states it."""
    if killed != 0:
        return status["peers"][str(killed)]["age_s"]
    found = re.search(r"has not answered for ([0-9.]+) s", status["problem"])
    assert found, status["problem"]
    return float(found.group(1))


@pytest.mark.parametrize("killed, survivor, needle", [(1, 0, "rank(s) [1] sent no heartbeat"),
                                                      (0, 1, "rendezvous store")])
def test_healthz_turns_unhealthy_within_the_peer_timeout_after_a_peer_rank_is_killed(tmp_path, killed, survivor,
                                                                                     needle):
    w = _world(tmp_path)
    try:
        time.sleep(4 * BEAT_S)
        assert [c.get("/v1/healthz").status_code for c in w.clients] == [200, 200]
        peers = w.clients[survivor].get("/v1/status").json()["peers"]
        assert set(peers) == {str(killed)} and peers[str(killed)]["age_s"] < PEER_TIMEOUT_S, peers
        os.kill(w.procs[killed].pid, signal.SIGKILL)
        w.procs[killed].wait(30)
        took, body = _unhealthy_within(w.clients[survivor], CEILING_S)
        print(f"healthz 503 {took:.2f} s after rank {killed} was killed (peer timeout {PEER_TIMEOUT_S} s)")
        assert body["error"]["type"] == "Unhealthy" and needle in body["error"]["message"], body
        # Not before the stated timeout either. Measured as the survivor's own silence figure, not as the
        # time since the kill: on a loaded machine the killed rank's last beats can already be late
        # before it dies (CI once saw 503 0.14 s after the kill, rightly: that peer had been silent 2 s).
        status = w.clients[survivor].get("/v1/status").json()
        assert status["healthy"] is False and needle in status["problem"]
        assert _silence_s(status, killed) >= PEER_TIMEOUT_S, status   # as stated: rounded (2.04 s reads 2.0)
        assert f'ckpt_healthy{{rank="{survivor}"}} 0.0' in w.clients[survivor].get("/metrics").text
    finally:
        codes = w.close()
    assert codes[survivor] == 0, f"the survivor still stops cleanly on SIGTERM: {codes}"
