"""The owner's copy of a slice on CUDA (``planning/boxcopy.py``, ``CudaBackend.copy_pitched``): host
memory pinned in pieces as the PS pins it, boxes that cross the pieces' borders, packed bit-exact
into device memory by pitched copies; and the rate of a column slice against torch's strided copy."""

import random
import time

import pytest
import torch

from ckpt_core.devices.cuda import CudaBackend
from ckpt_core.planning.boxcopy import box_copies, copied_bytes

pytestmark = pytest.mark.gpu

CHUNK = 1 << 20


@pytest.fixture(autouse=True)
def one_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _pinned(backend: CudaBackend, nbytes: int, chunk: int):
    host = backend.empty_host(nbytes)
    host.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    pins = [backend.pin(host[a: a + chunk]) for a in range(0, nbytes, chunk)]
    return host, pins


def test_boxes_across_pinned_pieces_pack_bit_exact_on_the_device():
    backend = CudaBackend()
    torch.cuda.set_device(0)
    host, pins = _pinned(backend, 8 * CHUNK, CHUNK)
    try:
        # CUDA refuses one copy across two pinned ranges (the reason the copies are cut); shown, not required
        try:
            torch.empty(4096, dtype=torch.uint8, device="cuda").copy_(host[CHUNK - 2048: CHUNK + 2048],
                                                                        non_blocking=True)
            torch.cuda.synchronize()
            print("a copy across two pinned ranges was accepted here")
        except Exception as exc:   # noqa: BLE001 - only shown
            print(f"a copy across two pinned ranges: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            torch.cuda.synchronize()
        rng = random.Random(3)
        stream = torch.cuda.Stream()
        for i in range(200):
            dtype = rng.choice([torch.bfloat16, torch.float32, torch.uint8])
            rows, cols = rng.randint(1, 1200), rng.randint(1, 1200)
            nbytes = rows * cols * dtype.itemsize
            base = rng.randrange(0, 8 * CHUNK - nbytes + 1) // 16 * 16
            if rng.random() < 0.5:
                a = rng.randrange(cols)
                offsets, extent = (0, a), (rows, rng.randint(1, cols - a))       # columns (row-parallel)
            else:
                a = rng.randrange(rows)
                offsets, extent = (a, 0), (rng.randint(1, rows - a), cols)       # rows (column-parallel)
            want = host[base: base + nbytes].view(dtype).view(rows, cols)
            want = want[offsets[0]: offsets[0] + extent[0], offsets[1]: offsets[1] + extent[1]].contiguous()
            copies = box_copies((rows, cols), offsets, extent, dtype.itemsize, base_offset=base, dst=64,
                                pin_chunk=CHUNK)
            dst = torch.zeros(64 + copied_bytes(copies), dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                backend.copy_pitched(dst, host, copies)
            stream.synchronize()
            got = dst[64:].cpu()
            assert torch.equal(got, want.view(torch.uint8).reshape(-1)), (i, rows, cols, offsets, extent, base)
            assert not dst[:64].any()
    finally:
        for p in pins:
            p.release()


def test_a_column_slice_of_pinned_memory_copies_at_the_links_rate():
    """Columns 0..1/8 of a 1 GiB bf16 matrix (a row-parallel layer's rank-0 slice at TP 8) pinned in
    the PS's 512 MiB pieces: pitched copies against torch's strided copy_ (printed, not asserted)."""
    from ckpt_core.planning.buckets import PIN_CHUNK

    backend = CudaBackend()
    torch.cuda.set_device(0)
    rows, cols = 16384, 32768
    host, pins = _pinned(backend, rows * cols * 2, PIN_CHUNK)
    try:
        box = ((0, 0), (rows, cols // 8))
        copies = box_copies((rows, cols), *box, 2)
        n = copied_bytes(copies)
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        view = host.view(torch.bfloat16).view(rows, cols)[:, : cols // 8]
        times = {}
        for what, run in (("pitched", lambda: backend.copy_pitched(dst, host, copies)),
                          ("torch strided", lambda: dst.view(torch.bfloat16).view(rows, cols // 8).copy_(
                              view, non_blocking=True))):
            best = None
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                best = min(best or 1e9, time.perf_counter() - t0)
            times[what] = best
        assert torch.equal(dst.cpu(), view.contiguous().view(torch.uint8).reshape(-1))
        print(f"column slice {n / 2**20:.0f} MiB in {len(copies)} copies: "
              + ", ".join(f"{k} {v * 1e3:.1f} ms ({n / v / 1e9:.1f} GB/s)" for k, v in times.items()))
    finally:
        for p in pins:
            p.release()


def test_merged_copies_of_a_layer_of_experts_pack_bit_exact_and_their_rates_are_printed():
    """Engine rank 1 of 8's slices of moe8's layer of 40 experts (320 x 2048 bf16), from host memory
    pinned in 64 MiB pieces: the merged copies (the gate rows of all experts as one pitched copy with
    a destination pitch, likewise the up rows) put the same bytes in the same places as the unmerged
    ones; times of both, and of the down slices' 80-byte rows alone, printed (not asserted)."""
    from support.boxcopy_cases import experts_layer
    from ckpt_core.devices.cpu import CpuBackend
    from ckpt_core.planning.boxcopy import merge_copies

    backend = CudaBackend()
    torch.cuda.set_device(0)
    chunk = 64 << 20   # the layer spans three pieces: a progression stops at a border
    copies, host_bytes, size = experts_layer(40, 320, 2048, t=1, tp=8, dst=0, pin_chunk=chunk)
    merged = merge_copies(copies, pin_chunk=chunk)
    assert len(merged) < len(copies) // 2 and any(c.dpitch for c in merged)
    host, pins = _pinned(backend, -(-host_bytes // chunk) * chunk, chunk)
    try:
        want = torch.zeros(size, dtype=torch.uint8)
        CpuBackend().copy_pitched(want, host, copies)
        narrow = [c for c in copies if c.height > 1]
        times = {}
        for what, chosen in (("unmerged", copies), ("merged", merged), ("down slices only", narrow)):
            dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
            best = None
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                backend.copy_pitched(dst, host, chosen)
                torch.cuda.synchronize()
                best = min(best or 1e9, time.perf_counter() - t0)
            times[what] = (best, copied_bytes(chosen), len(chosen))
            if chosen is not narrow:
                assert torch.equal(dst.cpu(), want), what
        print("a layer of 40 experts, rank 1 of 8: " + ", ".join(
            f"{k} {n} copies {t * 1e3:.2f} ms ({b / t / 1e9:.1f} GB/s)" for k, (t, b, n) in times.items()))
    finally:
        for p in pins:
            p.release()


def test_stacks_of_blocks_copy_bit_exact_in_one_3d_call_or_block_by_block_and_their_times_are_printed():
    """Copies of ``depth`` blocks on CUDA: stacks whose steps are whole rows go as one ``cuMemcpy3DAsync``
    (a layer of experts' down slices, with and without a destination pitch), others block by block
    (steps that are not whole rows); each against the CPU backend's strided copy of the same plan, and
    the layer's stacks timed as one call each against one 2-D call per block (printed, not asserted)."""
    from support.boxcopy_cases import experts_layer
    from ckpt_core.devices.cpu import CpuBackend
    from ckpt_core.devices.cuda import block_heights
    from ckpt_core.planning.boxcopy import Pitched, merge_copies

    backend = CudaBackend()
    torch.cuda.set_device(0)
    chunk = 64 << 20
    copies, host_bytes, size = experts_layer(40, 320, 2048, t=1, tp=8, dst=0, pin_chunk=chunk)
    stacks = [c for c in merge_copies(copies, pin_chunk=chunk) if c.depth > 1]
    assert stacks and all(block_heights(c) for c in stacks)
    odd = [Pitched(src=1000, pitch=512, width=100, height=7, dst=size, dpitch=0, depth=9, step=512 * 7 + 36,
                   dstep=100 * 7 + 4),   # neither step whole rows: block by block
           Pitched(src=200_000, pitch=640, width=64, height=5, dst=size + 8192, dpitch=96, depth=6, step=640 * 8,
                   dstep=96 * 6)]        # whole rows, a destination pitch wider than the row: one 3-D call
    assert block_heights(odd[0]) is None and block_heights(odd[1]) == (8, 6)
    total = size + 16384
    host, pins = _pinned(backend, -(-host_bytes // chunk) * chunk, chunk)
    try:
        for plan in (stacks, odd):
            want = torch.zeros(total, dtype=torch.uint8)
            CpuBackend().copy_pitched(want, host, plan)
            got = torch.zeros(total, dtype=torch.uint8, device="cuda")
            backend.copy_pitched(got, host, plan)
            torch.cuda.synchronize()
            assert torch.equal(got.cpu(), want)
        layers = [b for c in stacks for b in c.layers()]
        times = {}
        for what, plan in (("one 3-D call per stack", stacks), ("one 2-D call per block", layers)):
            dst = torch.zeros(total, dtype=torch.uint8, device="cuda")
            best = 1e9
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                backend.copy_pitched(dst, host, plan)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            times[what] = (best, t1 - t0, len(plan))
        print("a layer of 40 experts' down slices, rank 1 of 8: " + ", ".join(
            f"{k}: {n} calls, issued in {i * 1e6:.0f} us, done in {t * 1e3:.3f} ms" for k, (t, i, n) in times.items()))
    finally:
        for p in pins:
            p.release()
