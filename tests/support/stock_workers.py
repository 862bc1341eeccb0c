"""Engine workers that run the STOCK checkpoint-engine worker loop (the PyPI package, unmodified).

``scripts/stock_ce_env.sh`` installs releases into folders and ``scripts/test.sh`` exports
``CKPT_STOCK_CE="0.4.2=DIR 0.3.4=DIR ..."``. A worker process puts one folder first on its
``sys.path`` and calls that release's ``checkpoint_engine.worker.update_weights_from_ipc``.

The one stand-in is the stock worker's DeviceManager, which refuses a machine without a GPU or
NPU (``support/stock_cpu_device.py``); everything else is the stock code.
"""

from __future__ import annotations

import os
import sys

import pytest

from support import stock_cpu_device as cpu_device
from support.engine import SimEngine

STOCK_ENV = "CKPT_STOCK_CE"
# stock release -> the wire our PS must speak to it
WIRE_OF = {"0.4": "stock", "0.3": "stock-0.3", "0.2": "stock-0.3"}


def stock_dirs() -> dict[str, str]:
    """{version: folder} from ``$CKPT_STOCK_CE``."""
    out = {}
    for item in os.environ.get(STOCK_ENV, "").split():
        version, _, path = item.partition("=")
        if version and os.path.isdir(path):
            out[version] = path
    return out


def wire_of(version: str) -> str:
    return WIRE_OF[".".join(version.split(".")[:2])]


def stock_params(versions=None) -> list:
    """pytest params, one per installed release (skipped, with the reason, when none is)."""
    dirs = stock_dirs()
    wanted = versions or sorted(dirs, reverse=True) or ["0.4.2"]
    return [pytest.param((v, dirs.get(v)), id=f"ce-{v}",
                         marks=() if v in dirs else pytest.mark.skip(
                             reason=f"stock checkpoint-engine {v} not installed: run scripts/stock_ce_env.sh "
                                    f"and export {STOCK_ENV} (scripts/test.sh does)"))
            for v in wanted]


def load_stock_worker(folder: str, kind: str = "cpu"):
    """Import ``checkpoint_engine.worker`` from ``folder`` (first on sys.path); on the cpu kind with
    the DeviceManager stand-in (on cuda the stock DeviceManager runs unchanged)."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import checkpoint_engine.worker as stock
    assert os.path.dirname(os.path.dirname(stock.__file__)) == folder, (stock.__file__, folder)
    if kind == "cpu":
        cpu_device.install(stock)
    return stock


class StockSimEngine(SimEngine):
    """A simulated engine (``support.engine.SimEngine``) whose update is the stock worker's loop;
    ``behavior["stock_dir"]`` picks the release."""

    def __init__(self, kind: str, index: int, behavior: dict):
        super().__init__(kind, index, behavior)
        self.kind = kind
        if behavior.get("stock_dir"):   # import the release now, not inside the first update (whose timing
            load_stock_worker(behavior["stock_dir"], kind)   # some tests bound: a late worker must connect in time)

    def update(self, handles, this: dict) -> dict:
        stock = load_stock_worker(this["stock_dir"], self.kind)
        if this.get("connect_delay_s"):   # the engine reaches this worker late (after req_func posted)
            import time
            time.sleep(this["connect_delay_s"])
        run, post_hook, _on_plan, buckets = self.callbacks(this)   # stock workers have no plan check
        stock.update_weights_from_ipc(self.ctx, handles[self.key], self.index, run=run, post_hook=post_hook)
        self.updates += 1
        return {"buckets": buckets[0]}
