"""PS-side steps of the P2P tests, run inside PS processes through the harness's ``call`` command."""

from __future__ import annotations

import sys

from harness import make_req_func


def p2p_update(ps, rank, name, address, timeout, ranks, behaviors=None):
    """update(..., ranks=ranks) on every rank; the first target posts the targets' handles to the front."""
    first = min(ranks) if ranks else 0
    req = make_req_func(address, behaviors) if rank == first and address is not None else (lambda h: None)
    return ps.update(name, req, ranks=ranks, timeout=timeout)


def save_metas(ps, rank, path):
    if rank == 0:
        ps.save_metas(path)
    return ps.get_metas()


def load_metas(ps, rank, metas):
    return ps.load_metas(metas)


def hide_mooncake(ps, rank):
    """Make this process behave as if Mooncake were not installed."""
    for mod in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        del sys.modules[mod]
    sys.modules["mooncake"] = None   # import mooncake -> ImportError
    return None


def p2p_info(ps, rank):
    st = ps._p2p.store
    return None if st is None else {"address": st.address, "transport": st.transport,
                                    "quarantined": len(st.quarantine), "registered": len(st.registered)}
