"""Hardening (issue 14): each defect a hostile or unusual caller found, reproduced in a real PS world.

Every case here failed before its fix: it states the promise, provokes the defect with real
processes (PS ranks over gloo, engine workers behind an engine front) and asserts the outcome:
the typed error, the engines' digests, and a world that still delivers afterwards.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from support.asserts import assert_every_rank_failed
from support.data import fresh_tensors, want_digests
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld
from ckpt_core.checkpoint.safetensors import write_file

INIT = {"max_bucket_gb": (16 << 10) / (1 << 30)}
COLLECTIVE_TIMEOUT_S = 20.0      # a refusal must come well before any collective would time out
ENV = {"PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}


@pytest.fixture(scope="module")
def world():
    front = EngineFront("cpu", 2)
    ps = PsWorld("cpu", 2, init=INIT, env=ENV)
    try:
        yield ps, front, FreshCheckpoints(ps, seed=1414)
    finally:
        ps.close()
        front.close()


def only(doc: dict, name: str) -> dict:
    """The versioned metas document ``get_metas()`` returns, reduced to checkpoint ``name``."""
    return dict(doc, checkpoints={name: doc["checkpoints"][name]})


def legacy(doc: dict, name: str) -> list[list[dict]]:
    """Checkpoint ``name`` of a versioned metas document in the unversioned per-rank form."""
    keys = ("name", "dtype", "shape", "nbytes", "itemsize", "base", "base_offset")
    return [[dict(zip(keys, t)) for t in owner["tensors"]] for owner in doc["checkpoints"][name]["owners"]]


def assert_world_still_delivers(ps, front, ckpts) -> None:
    name, want = ckpts.new("genuine")
    got = ps.update(name, front, 30)
    assert all(o.ok for o in got.values()), got
    for i in range(ps.size):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want, f"engine worker {i} does not hold {name}"
    ckpts.drop(name)


# -- defect 1: a share made only of 0-byte tensors ------------------------------------------------
def test_a_rank_whose_share_is_only_zero_byte_tensors_delivers_them(world, tmp_path):
    ps, front, ckpts = world
    gen = torch.Generator().manual_seed(1)
    data0 = fresh_tensors({"w0": ((300,), torch.bfloat16), "w1": ((5, 7), torch.float32)}, gen)
    zeros = {"z1": torch.empty(0), "z2": torch.empty(3, 0, dtype=torch.float16)}
    only_empty = str(tmp_path / "empty.safetensors")
    write_file(only_empty, {"zf": torch.empty(0, 4, dtype=torch.bfloat16)})
    got = ps.all("register", per_rank={0: ("zero", {"named_tensors": data0}),
                                       1: ("zero", {"named_tensors": zeros, "files": [only_empty]})})
    assert all(o.ok for o in got.values()), got
    assert all(o.ok for o in ps.all("gather", "zero").values())
    got = ps.update("zero", front, 30)
    assert all(o.ok for o in got.values()), got
    want = want_digests(data0, zeros, {"zf": torch.empty(0, 4, dtype=torch.bfloat16)})
    for i in range(2):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want, f"engine worker {i} lacks the 0-byte tensors"
    assert all(o.ok for o in ps.all("unregister", ("zero", {})).values())
    assert_world_still_delivers(ps, front, ckpts)


# -- defect 2: a local pre-check failing on one rank ------------------------------------------------
def test_an_update_refused_on_one_rank_is_refused_on_every_rank_at_once_and_the_world_stays_usable(world):
    ps, front, ckpts = world
    name, _ = ckpts.new("half-gone")
    assert ps.all("unregister", (name, {}), ranks=[1])[1].ok
    got = ps.update(name, front, 3)
    assert_every_rank_failed(got, "CheckpointNotFoundError", repr(name), "not registered on rank 1", "rank(s) [1]")
    slowest = max(o.seconds for o in got.values())
    # Before: rank 0 waited for PS_COLLECTIVE_TIMEOUT_S and the world refused all further work.
    assert slowest < COLLECTIVE_TIMEOUT_S, f"a refusal must not wait for the collective timeout ({slowest:.1f} s)"
    assert ps.all("unregister", (name, {}), ranks=[0])[0].ok
    assert_world_still_delivers(ps, front, ckpts)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0, "soon"], ids=["nan", "negative", "zero", "str"])
def test_a_bad_update_timeout_on_one_rank_is_a_config_error_on_every_rank(world, bad):
    ps, front, ckpts = world
    name, _ = ckpts.new("bad-timeout")
    args = {0: (name, front.address, 30, None), 1: (name, None, bad, None)}
    got = ps.collect(ps.send("update", per_rank=args), timeout=120)
    assert_every_rank_failed(got, "ConfigError", "update timeout", "rank(s) [1]")
    assert max(o.seconds for o in got.values()) < COLLECTIVE_TIMEOUT_S
    ckpts.drop(name)
    assert_world_still_delivers(ps, front, ckpts)


def test_gather_metas_with_a_bad_name_on_one_rank_is_refused_on_every_rank(world):
    ps, front, ckpts = world
    name, _ = ckpts.new("gather-bad")
    got = ps.collect(ps.send("gather", per_rank={0: name, 1: ["not", "a", "name"]}), timeout=120)
    assert_every_rank_failed(got, "ConfigError", "rank(s) [1]", "checkpoint name")
    assert max(o.seconds for o in got.values()) < COLLECTIVE_TIMEOUT_S
    ckpts.drop(name)
    assert_world_still_delivers(ps, front, ckpts)


def test_a_rank_that_holds_no_data_updates_with_metas_it_loaded(world):
    ps, front, ckpts = world
    gen = torch.Generator().manual_seed(2)
    data = fresh_tensors({"only0.a": ((999,), torch.float16), "only0.b": ((4, 33), torch.bfloat16)}, gen)
    got = ps.all("register", per_rank={0: ("r0-only", {"named_tensors": data}), 1: ("r0-only", {"named_tensors": {}})})
    assert all(o.ok for o in got.values()) and all(o.ok for o in ps.all("gather", "r0-only").values())
    metas = ps.all("get_metas", ranks=[0])[0].value
    assert ps.all("unregister", ("r0-only", {}), ranks=[1])[1].ok          # rank 1 now holds nothing
    assert ps.all("load_metas", only(metas, "r0-only"), ranks=[1])[1].ok
    got = ps.update("r0-only", front, 30)
    assert all(o.ok for o in got.values()), got
    for i in range(2):
        held = front.digests(i)
        assert {n: held.get(n) for n in data} == want_digests(data)
    assert ps.all("unregister", ("r0-only", {}), ranks=[0])[0].ok
    assert_world_still_delivers(ps, front, ckpts)


# -- defect 4: close() and unregister_checkpoint() racing an update ---------------------------------
def test_unregistering_the_checkpoint_being_updated_is_refused_and_the_update_delivers(world, tmp_path):
    from support.ps_fault_cases import act_mid_update
    ps, front, ckpts = world
    name, want = ckpts.new("busy")
    got = act_mid_update(ps, front, name, tmp_path, 1, "unregister")
    assert got[1]["action"].startswith("ConfigError") and "while an update is running" in got[1]["action"], got
    assert got[0]["update"] == "ok" and got[1]["update"] == "ok", got
    for i in range(2):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want
    ckpts.drop(name)


@pytest.mark.parametrize("world", [1, 2])
def test_close_during_an_update_stops_it_on_every_rank_with_a_typed_error_then_frees(world, tmp_path):
    from support.ps_fault_cases import close_a_rank_mid_update
    front = EngineFront("cpu", world)
    try:
        close_a_rank_mid_update("cpu", front, tmp_path, world)
    finally:
        front.close()


# -- defect 6: load_metas is all or nothing ----------------------------------------------------------
def test_load_metas_validates_everything_before_installing_anything(world):
    ps, front, ckpts = world
    name, want = ckpts.new("saved")
    saved = legacy(ps.all("get_metas", ranks=[0])[0].value, name)
    three_ranks = saved + [[]]
    misshapen = [[dict(m, nbytes=m["nbytes"] + 1) for m in saved[0]], saved[1]]
    known = {r: set(o.value["checkpoints"]) for r, o in ps.all("get_metas").items()}
    for bad, needle in ((three_ranks, "describe 3 ranks"), (misshapen, "do not match shape"),
                        ([saved[0], saved[0]], "twice")):
        got = ps.all("load_metas", {"fine": saved, "bad": bad})
        assert_every_rank_failed(got, "ConfigError", "'bad'", needle)
        held = {r: set(o.value["checkpoints"]) for r, o in ps.all("get_metas").items()}
        assert held == known, f"a refused load installed metas: {held}"
    got = ps.update("bad", front, 10)            # nothing of it was installed: a clean refusal
    assert_every_rank_failed(got, "CheckpointNotFoundError", "'bad'")
    assert all(o.ok for o in ps.all("load_metas", {name: saved}).values())
    got = ps.update(name, front, 30)             # a valid load works and the world is intact
    assert all(o.ok for o in got.values()), got
    for i in range(2):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want
    ckpts.drop(name)


# -- defect 7: an infinite update timeout has a meaning ----------------------------------------------
@pytest.mark.parametrize("timeout", [float("inf"), timedelta.max], ids=["inf", "timedelta.max"])
def test_an_infinite_update_timeout_means_no_deadline_and_the_update_delivers(world, timeout):
    ps, front, ckpts = world
    name, want = ckpts.new("no-deadline")
    got = ps.all("update", (name, front.address, timeout, None), timeout=120)
    assert all(o.ok for o in got.values()), got
    for i in range(2):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want
    ckpts.drop(name)


# -- defect 8: every dtype torch and safetensors share, and torch-only ones for named tensors ----------
def random_bytes_as(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (never all zero) viewed as ``dtype``: a byte-exact check needs no arithmetic."""
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(1, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def test_mx_scales_complex_and_fnuz_float8_arrive_bit_exact_from_files_and_named_tensors(world, tmp_path):
    from ckpt_core.checkpoint.safetensors import DTYPES, WIRE_DTYPES
    ps, front, ckpts = world
    gen = torch.Generator().manual_seed(8)
    in_file = {f"file.{code}": random_bytes_as((3, 5), DTYPES[code], gen)
               for code in ("F8_E8M0", "C64", "F8_E4M3FNUZ", "F8_E5M2FNUZ")}
    from safetensors.torch import save_file    # written by the reference implementation, not ours
    path = str(tmp_path / "mx.safetensors")
    save_file(in_file, path)
    named = {f"named.{code}": random_bytes_as((7,), dt, gen) for code, dt in WIRE_DTYPES.items() if dt != torch.bool}
    named["named.bool"] = torch.randint(0, 2, (9,), generator=gen).bool()
    got = ps.all("register", per_rank={0: ("dtypes", {"files": [path]}), 1: ("dtypes", {"named_tensors": named})})
    assert all(o.ok for o in got.values()), got
    assert all(o.ok for o in ps.all("gather", "dtypes").values())
    got = ps.update("dtypes", front, 30)
    assert all(o.ok for o in got.values()), got
    want = want_digests(in_file, named)
    for i in range(2):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want, f"engine worker {i}: a dtype did not arrive bit-exact"
    assert all(o.ok for o in ps.all("unregister", ("dtypes", {})).values())


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_named_tensor_of_a_dtype_we_cannot_carry_is_called_unsupported(world):
    ps, front, ckpts = world
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    got = ps.all("register", ("quantized", {"named_tensors": {"q": q}}), ranks=[0])[0]
    assert not got.ok and got.error == "ConfigError" and "unsupported" in got.message, got


# -- defect 5: close()/abort() free the groups the PS created in the caller's default group ------------
@pytest.mark.parametrize("mode", ["close", "abort"])
def test_parameter_servers_in_a_trainers_default_group_leave_no_process_groups_or_fds_behind(mode):
    from support.ps_fault_cases import assert_census_clean, group_census
    assert_census_clean(group_census("cpu", 10, mode))
