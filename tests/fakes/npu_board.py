"""A fake Ascend board shared by the fake torch_npu and the fake ``npu-smi`` (tests only).

State lives in the folder named by ``FAKE_NPU_STATE``: ``board.json`` describes the
board, ``pids/<pid>`` lists the physical chips a process opened (written by the fake
``torch.npu.set_device``), so ``npu-smi`` in another process sees who uses which chip,
as the real driver does. Physical chip number = ``npu_id * chips + chip_id``.

board.json: ``{"npu_ids": [0, 1], "chips": 2, "proc_mem": "ok"}``; ``proc_mem`` may be
``"unsupported"`` (the documented answer of boards without it) or ``"garbled"``.
"""

from __future__ import annotations

import json
import os

STATE_ENV = "FAKE_NPU_STATE"
LABEL_WIDTH = 31   # npu-smi pads "Label" to this width before " : value"


def state_dir() -> str:
    path = os.environ.get(STATE_ENV)
    if not path:
        raise RuntimeError(f"fake NPU: {STATE_ENV} is not set (the test did not set up a fake board)")
    return path


def make_board(path: str, npu_ids: list[int], chips: int, proc_mem: str = "ok") -> str:
    os.makedirs(os.path.join(path, "pids"), exist_ok=True)
    with open(os.path.join(path, "board.json"), "w") as f:
        json.dump({"npu_ids": list(npu_ids), "chips": chips, "proc_mem": proc_mem}, f)
    return path


def board() -> dict:
    with open(os.path.join(state_dir(), "board.json")) as f:
        return json.load(f)


def physical_chips() -> list[int]:
    b = board()
    return sorted(n * b["chips"] + c for n in b["npu_ids"] for c in range(b["chips"]))


def visible() -> list[int]:
    """Physical chips behind logical indices 0, 1, ... in this process (ASCEND_RT_VISIBLE_DEVICES)."""
    raw = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    chips = physical_chips()
    if not raw:
        return chips
    ids = [int(x) for x in raw.split(",")]
    missing = [i for i in ids if i not in chips]
    if missing:
        raise RuntimeError(f"fake NPU: ASCEND_RT_VISIBLE_DEVICES names chips {missing} this board lacks ({chips})")
    return ids


def physical(index: int) -> int:
    chips = visible()
    if not 0 <= index < len(chips):
        raise RuntimeError(f"fake NPU: invalid device id {index} ({len(chips)} visible devices)")
    return chips[index]


def record_open(pid: int, chip: int) -> None:
    path = os.path.join(state_dir(), "pids", str(pid))
    with open(path, "a") as f:
        f.write(f"{chip}\n")


def users() -> dict[int, list[int]]:
    """physical chip -> pids that opened it."""
    out: dict[int, list[int]] = {}
    folder = os.path.join(state_dir(), "pids")
    for name in sorted(os.listdir(folder), key=int):
        with open(os.path.join(folder, name)) as f:
            for chip in {int(x) for x in f.read().split()}:
                out.setdefault(chip, []).append(int(name))
    return out


def label(name: str, value) -> str:
    return f"        {name.ljust(LABEL_WIDTH)}: {value}"


def render_proc_mem(npu_id: int, chips: int, procs: dict[int, list[tuple[int, str, int]]]) -> str:
    """``npu-smi info -t proc-mem -i <npu_id>`` as the tool prints it: per chip, its process lines,
    then its ``Chip ID`` line. ``procs``: chip id -> [(pid, process name, memory MB)]."""
    lines = [label("NPU ID", npu_id), label("Chip Count", chips), ""]
    for chip in range(chips):
        rows = procs.get(chip, [])
        for pid, name, mem in rows:
            lines.append(f"        Process id:{pid}  Process name:{name}  Process memory(MB):{mem}")
        if not rows:
            lines.append("        No process in device.")
        lines.append(label("Chip ID", chip))
    return "\n".join(lines) + "\n"


def npu_smi(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the fake ``npu-smi``; only ``info -t proc-mem -i N`` is known."""
    if argv[:3] != ["info", "-t", "proc-mem"] or len(argv) != 5 or argv[3] != "-i":
        return 2, "", f"fake npu-smi: unsupported arguments {argv}\n"
    b, npu_id = board(), int(argv[4])
    if npu_id not in b["npu_ids"]:
        return 255, "", f"Error: the input -i {npu_id} is invalid, no such device\n"
    if b["proc_mem"] == "unsupported":
        return 0, "This device does not support querying proc-mem.\n", ""
    if b["proc_mem"] == "garbled":
        return 0, "NPU ID : ?\n%%% driver error 0x7f %%%\n", ""
    taken = users()
    procs = {c: [(pid, "python3", 3127) for pid in taken.get(npu_id * b["chips"] + c, [])]
             for c in range(b["chips"])}
    return 0, render_proc_mem(npu_id, b["chips"], procs), ""


if __name__ == "__main__":   # the fake npu-smi (tests/fakes/bin/npu-smi) runs this
    import sys
    code, out, err = npu_smi(sys.argv[1:])
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.exit(code)
