"""Slices as the owner of a layer of experts packs them, for the pitched-copy tests (unit and GPU)."""

from ckpt_core.planning.boxcopy import box_copies
from ckpt_core.planning.buckets import PIN_CHUNK, align_up


def experts_layer(experts: int, rows: int, cols: int, *, t: int, tp: int, itemsize: int = 2, dst: int = 0,
                  pin_chunk: int = PIN_CHUNK):
    """One layer's experts in host order (gate, up, down of each, back to back) and engine rank ``t``'s
    slices of them packed one after another as a bucket of slices packs them (256-aligned): the gate
    and up rows (column-parallel), the down columns (row-parallel). Returns (copies, host bytes,
    destination bytes)."""
    tensor = rows * cols * itemsize
    r = rows // tp
    copies, host = [], 0
    for _ in range(experts):
        for shape, offsets, extent in (((rows, cols), (t * r, 0), (r, cols)), ((rows, cols), (t * r, 0), (r, cols)),
                                       ((cols, rows), (0, t * r), (cols, r))):
            copies += box_copies(shape, offsets, extent, itemsize, base_offset=host, dst=dst, pin_chunk=pin_chunk)
            dst = align_up(dst + r * cols * itemsize)
            host += tensor
    return copies, host, dst
