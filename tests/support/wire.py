"""Wire content the protocol tests build by hand: a payload that proves nothing from a socket was
unpickled, and a hello with its plan inline."""

from __future__ import annotations


class PickleBomb:
    """Unpickling this would create a file: proof that nothing from a socket was unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def hello_fields(device_kind: str, buffer: dict, slot_bytes: int, num_slots: int,
                 buckets: list[list[tuple[str, str, tuple[int, ...], int]]]) -> dict:
    """A hello's fields with its plan inline (``buckets``), for ``protocol.encode("hello", ...)``: the
    PS sends the plan as a second frame (``plan_fragment``); tests build small ones by hand."""
    return {"device_kind": device_kind, "buffer": buffer, "slot_bytes": slot_bytes,
            "num_slots": num_slots, "buckets": [[[n, d, list(s), o] for n, d, s, o in b] for b in buckets]}
