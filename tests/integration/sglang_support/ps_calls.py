"""Commands a ``support.world.PsWorld`` rank runs for the SGLang tests (``world.all("call", ("sglang_support.ps_calls",
fn, args))``): the PS update whose ``req_func`` posts to the SGLang server from rank 0, as a
launcher's first rank of an inference group does (every rank's ``req_func`` runs; the others return)."""

from __future__ import annotations


def update(ps, rank: int, name: str, url: str, timeout: float, stage: str | None = None,
           weight_version: str | None = None, via: str | None = None) -> dict:
    """A plain update (``weight_version``, through ``via``) or a stage (``stage``) of checkpoint ``name``
    into the server at ``url``."""
    from ckpt_sglang import SglangClient

    if rank != 0:
        return ps.update(name, lambda handles: None, timeout=timeout)
    with SglangClient(url, timeout=timeout) as client:
        kwargs = {"stage": stage} if stage is not None else {"weight_version": weight_version, "via": via}
        return ps.update(name, client.req_func(**kwargs), timeout=timeout)


def delta_update(ps, rank: int, name: str, url: str, timeout: float, delta=True) -> dict:
    """An update of ``name`` (``delta``: True, "fallback" or False) through our loader with ``deltas``:
    rank 0 posts (its result carries the workers' replies), the others' ``req_func`` posts nothing
    and is marked as taking deltas (``accepts_deltas``)."""
    from ckpt_core.delta.versions import accepts_deltas
    from ckpt_sglang import SglangClient

    if rank != 0:
        return ps.update(name, accepts_deltas(lambda handles: None), timeout=timeout, delta=delta)
    with SglangClient(url, timeout=timeout) as client:
        result = ps.update(name, client.req_func(deltas=True, weight_version=name), timeout=timeout, delta=delta)
        result["workers"] = client.last_report.workers
        return result


def registered(ps, rank: int, name: str) -> bool:
    return name in ps._catalog.checkpoints
