"""examples/rl_controller.py, run as written, against two real `ckpt-engine serve` processes and an
engine behind a real HTTP /collective_rpc: one checkpoint per step reaches the engine, a refused
step leaves the engine on the previous weights and nothing registered, --keep-going carries on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
from support.data import FAULT_DTYPES, fresh_tensor, want_digests  # noqa: E402
from support.service_world import HttpEngineFront, ServiceWorld  # noqa: E402
from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rl_controller.py"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("rl"))
    w = ServiceWorld(2, tmp, env={"PS_MAX_BUCKET_SIZE_GB": "0.0001"})   # ~100 KiB buckets: several per update
    w.front, w.gen = HttpEngineFront(2), torch.Generator().manual_seed(2603)
    yield w
    w.front.close()
    assert w.close() == [0, 0]


def _step_dir(world, name: str, *, corrupt: bool = False) -> tuple[str, dict, int]:
    """A checkpoint directory of 3 safetensors files with fresh values; the digests it must leave
    and its tensor bytes."""
    d = Path(world.tmp) / name
    d.mkdir()
    data = {}
    for f in range(3):
        ts = {f"layer{f}.w{i}": fresh_tensor((2000 + 331 * i,), FAULT_DTYPES[(f + i) % 4], world.gen) for i in range(4)}
        write_file(d / f"model-{f:05d}.safetensors", ts)
        data.update(ts)
    if corrupt:   # a truncated shard: the header promises more bytes than the file has
        p = d / "model-00001.safetensors"
        p.write_bytes(p.read_bytes()[:-1000])
    return str(d), want_digests(data), sum(t.numel() * t.element_size() for t in data.values())


def _run(world, *dirs: str, extra=()) -> tuple[int, list[dict], str]:
    cmd = [sys.executable, str(EXAMPLE), "--ps-uds", os.path.join(world.tmp, "ps-{rank}.sock"), "--world-size", "2",
           "--update-url", world.front.url, "--timeout", "60", *extra, *dirs]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(ROOT))
    return p.returncode, [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")], p.stderr


def _held(world) -> dict:
    held = {}
    for i in range(world.size):
        held.update(world.front.engine.digests(i))
    return held


def _registered(world) -> list:
    return [sorted(c.get("/v1/status").json()["checkpoints"]) for c in world.clients]


def test_each_step_reaches_the_engine_and_only_the_last_stays_registered(world):
    (d1, w1, _), (d2, w2, n2) = _step_dir(world, "a1"), _step_dir(world, "a2")
    code, lines, err = _run(world, d1, d2)
    assert code == 0, err[-3000:]
    assert [(x["step"], x["ok"]) for x in lines] == [(1, True), (2, True)], lines
    assert lines[1]["bytes"] == n2 and lines[1]["update_s"] > 0, lines[1]
    held = _held(world)
    assert all(held.get(k) == v for k, v in w2.items()), "the engine holds the last step's weights"
    assert not any(held.get(k) == v for k, v in w1.items()), "no tensor of step 1 is left"
    assert _registered(world) == [["a2"], ["a2"]], "the previous step was unregistered"


def test_a_refused_step_stops_the_run_and_leaves_the_engine_on_its_weights(world):
    d1, w1, _ = _step_dir(world, "b1")
    assert _run(world, d1)[0] == 0
    bad = _step_dir(world, "b2", corrupt=True)[0]
    code, lines, err = _run(world, bad, _step_dir(world, "b3")[0])
    assert code == 1, err[-3000:]
    assert len(lines) == 1 and lines[0]["ok"] is False, lines   # stopped at the refused step
    assert "CheckpointFormatError" in lines[0]["error"] and "model-00001.safetensors" in lines[0]["error"], lines
    held = _held(world)
    assert all(held.get(k) == v for k, v in w1.items()), "the engine keeps the weights of the step before"
    assert _registered(world) == [["b1"], ["b1"]], "the refused step left nothing registered"


def test_keep_going_skips_a_refused_step_and_applies_the_next(world):
    d1, bad = _step_dir(world, "c1")[0], _step_dir(world, "c2", corrupt=True)[0]
    d3, w3, _ = _step_dir(world, "c3")
    missing = os.path.join(world.tmp, "no-such-step")
    code, lines, err = _run(world, d1, bad, missing, d3, extra=["--keep-going"])
    assert code == 1, err[-3000:]
    assert [(x["step"], x["ok"]) for x in lines] == [(1, True), (2, False), (3, False), (4, True)], lines
    assert "does not exist" in lines[2]["error"], lines[2]
    held = _held(world)
    assert all(held.get(k) == v for k, v in w3.items()), "the step after the refused ones reached the engine"
    assert _registered(world) == [["c3"], ["c3"]]
