"""The engine side of a delta, in process: which plans are deltas, the base refusal before any write,
the scatter and the rebuild paths, the undo of a failed delta, and the PS-side refusals."""

import pytest
import torch

from ckpt_core.delta.apply import DeltaReceiver, delta_of_plan
from ckpt_core.delta.encode import encode_tensor
from ckpt_core.delta.pieces import PIECE
from ckpt_core.delta.sliced import BOX
from ckpt_core.delta.versions import PAYLOAD, manifest_name, parse_manifest_name
from ckpt_core.errors import CheckpointFormatError, DeltaBaseError

U8 = torch.uint8


def _listing(*names):
    return [(n, U8, (1,)) for n in names]


def test_a_plan_is_a_delta_only_with_every_rank_s_agreeing_manifest():
    m0, m1 = manifest_name("A", "B", 0, 2), manifest_name("A", "B", 1, 2)
    assert parse_manifest_name(m1) == ("A", "B", 1, 2)
    assert delta_of_plan(_listing("w", "v")) is None
    assert delta_of_plan(_listing(m0, m1, PAYLOAD + "w")) == ("A", "B")
    with pytest.raises(DeltaBaseError, match="ranks \\[0\\]"):
        delta_of_plan(_listing(m0, PAYLOAD + "w"))
    with pytest.raises(DeltaBaseError, match="disagree"):
        delta_of_plan(_listing(m0, manifest_name("X", "B", 1, 2)))
    with pytest.raises(CheckpointFormatError, match="whole tensors"):
        delta_of_plan(_listing(m0, m1, "w"))
    with pytest.raises(CheckpointFormatError, match="no delta manifest"):
        delta_of_plan(_listing(PAYLOAD + "w"))


@pytest.mark.parametrize("prefix", [PAYLOAD, BOX, PIECE])
def test_a_delta_name_anywhere_in_a_plan_is_seen_by_the_one_search_for_delta_names(prefix):
    # the search over the names joined (no call per name) must find every kind of delta name, first or last
    assert delta_of_plan(_listing("w", "ckpt.deltas", "x.ckpt.delta:w", "v")) is None
    for names in ([prefix + "w", "a", "b"], ["a", "b", prefix + "w"]):
        with pytest.raises(CheckpointFormatError, match="no delta manifest"):
            delta_of_plan(_listing(*names))
    m0 = manifest_name("A", "B", 0, 1)
    assert delta_of_plan(_listing(prefix + "w", m0)) == ("A", "B")


def _drive(rx, weights, *, version=None, fail=False):
    """One update's callbacks as the receive loop calls them (one bucket)."""
    listing = [(n, t.dtype, tuple(t.shape)) for n, t in weights]
    with rx.update(run=lambda ws: [full.__setitem__(n, t.clone()) for n, t in ws], version=version) as cb:
        cb.on_plan(listing)
        cb.run(weights)
        if fail:
            raise RuntimeError("another rank failed")
        cb.post_hook()


full: dict = {}


def _delta_weights(base, new, names, b="A", v="B"):
    out = [(manifest_name(b, v, 0, 1), torch.zeros(1, dtype=U8))]
    for n in names:
        payload, _ = encode_tensor(new[n], base[n])
        if payload is not None:
            out.append((PAYLOAD + n, payload))
    return out


def test_scatter_and_rebuild_then_undo_on_failure():
    gen = torch.Generator().manual_seed(1)
    base = {"s": torch.randn(64, 8, generator=gen).to(torch.bfloat16), "d": torch.randn(32, generator=gen).half()}
    new = {n: t.clone() for n, t in base.items()}
    new["s"].view(torch.int16)[3, 2] ^= 5
    new["d"].view(torch.int16)[7] ^= 1
    live = {"s": base["s"].clone()}
    derived = {"d": base["d"].float()}
    rx = DeltaReceiver(live=live.get, reload=lambda ws: derived.update({n: t.float() for n, t in ws}), held="A")
    rx.keep("d", base["d"])
    weights = _delta_weights(base, new, ["s", "d"])
    with pytest.raises(RuntimeError, match="another rank"):
        _drive(rx, weights, fail=True)
    assert torch.equal(live["s"], base["s"]) and torch.equal(derived["d"], base["d"].float()) and rx.held == "A"
    _drive(rx, weights)
    assert torch.equal(live["s"].view(torch.int16), new["s"].view(torch.int16))
    assert torch.equal(derived["d"], new["d"].float()) and rx.held == "B" and rx.last["scattered"] == 1
    assert torch.equal(rx.kept["d"].view(torch.int16), new["d"].view(torch.int16))   # the next delta's base


def test_a_delta_of_another_base_is_refused_before_any_write():
    base = {"s": torch.arange(16, dtype=torch.float32)}
    new = {"s": base["s"] + 1}
    live = {"s": base["s"].clone()}
    rx = DeltaReceiver(live=live.get, held="Z")
    with pytest.raises(DeltaBaseError, match="holds 'Z', not the base 'A'"):
        _drive(rx, _delta_weights(base, new, ["s"]))
    assert torch.equal(live["s"], base["s"]) and rx.held == "Z"


def test_a_full_update_sets_the_held_version_and_a_failed_one_forgets_it():
    rx = DeltaReceiver(live=lambda n: None, held="A")
    _drive(rx, [("w", torch.ones(2))], version="B")
    assert rx.held == "B"
    with pytest.raises(RuntimeError):
        _drive(rx, [("w", torch.ones(2))], version="C", fail=True)
    assert rx.held is None


def test_the_ps_refuses_what_it_knows_is_not_held():
    from ckpt_core.delta.choose import choose, view

    def views(default, holds):
        cands = {} if default is None else {default: ["B@delta", True, False]}
        return [view("B", cands, default, holds, True)] * 2
    with pytest.raises(DeltaBaseError, match=r"not registered with a base on rank\(s\) \[0, 1\]"):
        choose(views(None, None), "B", p2p=False, known={})
    assert choose(views("A", None), "B", p2p=False, known={}) == ("A", "B@delta")   # unknown: the workers decide
    assert choose(views("A", "A"), "B", p2p=False, known={}) == ("A", "B@delta")
    with pytest.raises(DeltaBaseError, match="last made 'C' live"):
        choose(views("A", "C"), "B", p2p=False, known={})


def test_a_widened_live_tensor_takes_the_delta_cast_up_and_a_failure_puts_it_back():
    """An engine serving a bf16 checkpoint in float32: the scatter casts up (exact), the digest is
    checked cast back; an abort restores the float32 values."""
    gen = torch.Generator().manual_seed(2)
    base = {"n": torch.randn(4, 16, generator=gen).to(torch.bfloat16)}
    new = {"n": base["n"].clone()}
    new["n"].view(torch.int16)[1, 3] ^= 9
    new["n"].view(torch.int16)[2, 0] ^= 3
    live = {"n": base["n"].float()}
    rx = DeltaReceiver(live=live.get, held="A")
    weights = _delta_weights(base, new, ["n"])
    with pytest.raises(RuntimeError, match="another rank"):
        _drive(rx, weights, fail=True)
    assert torch.equal(live["n"], base["n"].float()) and rx.held == "A"
    _drive(rx, weights)
    assert torch.equal(live["n"], new["n"].float()) and rx.last["scattered_tensors"] == ["n"]


def test_a_narrowing_live_tensor_is_refused():
    base = {"n": torch.randn(8)}
    new = {"n": base["n"] + 1}
    live = {"n": base["n"].to(torch.bfloat16)}
    rx = DeltaReceiver(live=live.get, held="A")
    with pytest.raises(CheckpointFormatError, match="live tensor is torch.bfloat16"):
        _drive(rx, _delta_weights(base, new, ["n"]))
    assert rx.held == "A"


def test_the_deferred_reload_gets_the_changed_tensors_with_their_companions_read_from_the_engine():
    """``complete`` as a callable names the unchanged tensors that reload with the changed ones;
    their bytes come from ``base`` (the engine's verbatim copy) where nothing is kept; the kept copy
    is updated only for the tensors it held."""
    gen = torch.Generator().manual_seed(3)
    base = {n: torch.randn(6, generator=gen).to(torch.bfloat16) for n in ("q", "k", "v", "o")}
    new = {n: t.clone() for n, t in base.items()}
    new["q"].view(torch.int16)[0] ^= 1
    engine = {"q": base["q"].clone(), "k": base["k"].clone()}   # readable back from the engine
    reloaded: list = []
    rx = DeltaReceiver(live=lambda n: None, reload=lambda ws: reloaded.append(dict(ws)), held="A",
                       defer_reload=True, complete=lambda names: ["q", "k", "v"] if "q" in names else [],
                       base=lambda n: engine.get(n))
    rx.keep("v", base["v"])
    rx.keep("o", base["o"])
    _drive(rx, _delta_weights(base, new, ["q", "k", "v", "o"]))
    assert len(reloaded) == 1 and sorted(reloaded[0]) == ["k", "q", "v"]   # not o: another layer
    assert torch.equal(reloaded[0]["q"].view(torch.int16), new["q"].view(torch.int16))
    assert torch.equal(reloaded[0]["k"], base["k"]) and torch.equal(reloaded[0]["v"], base["v"])
    assert sorted(rx.kept) == ["o", "v"] and rx.held == "B"
