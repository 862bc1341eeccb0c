"""Lossless delta updates (issue 39): a version registered against its base moves only its changed
elements; the engine worker applies them in place and checks the version's digests afterwards.

- ``encode``: the per-tensor payload (exact byte comparison; sparse indices, bitmap or runs,
  whichever is smallest; a tensor whose encoding is not smaller than itself goes whole).
- ``versions``: the PS side: a version's delta as a companion checkpoint of payloads, and the
  refusal of a delta whose base is not what the engines hold.
- ``apply``: the engine side, engine-agnostic: scatter into live tensors that hold the
  checkpoint's bytes, or rebuild the full tensor for the engine's own reload; digests checked
  after the apply; undo on any failure.
"""
