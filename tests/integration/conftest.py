"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest
from support.delta_world import DERIVED, DeltaEngine
from support.engine import EngineFront
from support.world import PsWorld


@pytest.fixture(params=["per-bucket", "deferred"])
def world_and_front(request):
    """A world of PS ranks and an engine front of ``DeltaEngine`` workers, sized by the test module's
    ``WORLD``; the tensors named by its ``DERIVED`` (else ``delta_world.DERIVED``) are held in a derived form, so a delta reaches them
    by a rebuild and reload: per bucket (undone by reloading their base), or once in the post hook with
    every kept tensor (vLLM's extension's way: nothing loaded before every rank checked)."""
    size, derived = request.module.WORLD, getattr(request.module, "DERIVED", DERIVED)
    world = PsWorld("cpu", size)
    front = EngineFront("cpu", size, behavior={"derived": derived, "defer": request.param == "deferred"},
                        engine_cls=DeltaEngine)
    try:
        yield world, front
    finally:
        front.close()
        world.close()
