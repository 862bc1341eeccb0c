"""Prometheus metrics of one parameter-server rank (optional: needs ``prometheus-client``).

Each :class:`Metrics` owns its own registry, so two services in one process (tests) never
collide and nothing leaks into the process-wide default registry. Without
``prometheus-client`` installed, :func:`make_metrics` returns ``None`` and the service answers
``/metrics`` with 501 naming the missing package.

Exported series (all carry the label ``rank``):

- ``ckpt_operations_total{operation, outcome}``: register/unregister/gather/update/load_metas calls
- ``ckpt_operation_failures_total{operation, error}``: failures by ``ckpt_core.errors`` class
- ``ckpt_operation_seconds{operation}``: histogram of durations
- ``ckpt_update_bytes_total``: model bytes pushed into engines by successful updates
- ``ckpt_last_update_phase_seconds{phase}``: per-phase timings of the last successful update
- ``ckpt_operation_running``: 1 while a long operation runs
"""

from __future__ import annotations

try:
    import prometheus_client as _prom
except ImportError:   # optional dependency (extra "server")
    _prom = None

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def available() -> bool:
    return _prom is not None


class Metrics:
    """The series above for one rank, in a private registry."""

    def __init__(self, rank: int):
        reg = self.registry = _prom.CollectorRegistry(auto_describe=True)
        self.rank = str(rank)
        self.ops = _prom.Counter("ckpt_operations", "Long operations by outcome", ["rank", "operation", "outcome"],
                                 registry=reg)
        self.failures = _prom.Counter("ckpt_operation_failures", "Failed operations by error class",
                                      ["rank", "operation", "error"], registry=reg)
        self.seconds = _prom.Histogram("ckpt_operation_seconds", "Duration of long operations",
                                       ["rank", "operation"], buckets=_BUCKETS, registry=reg)
        self.update_bytes = _prom.Counter("ckpt_update_bytes", "Model bytes pushed by successful updates",
                                          ["rank"], registry=reg)
        self.phase = _prom.Gauge("ckpt_last_update_phase_seconds", "Phases of the last successful update",
                                 ["rank", "phase"], registry=reg)
        self.running = _prom.Gauge("ckpt_operation_running", "1 while a long operation runs", ["rank"], registry=reg)

    def started(self) -> None:
        self.running.labels(self.rank).set(1)

    def succeeded(self, operation: str, seconds: float, nbytes: int | None, update: dict | None) -> None:
        self.ops.labels(self.rank, operation, "ok").inc()
        self.seconds.labels(self.rank, operation).observe(seconds)
        self.running.labels(self.rank).set(0)
        if update is not None:
            self.update_bytes.labels(self.rank).inc(nbytes or 0)
            for phase, value in (update.get("seconds") or {}).items():
                if isinstance(value, (int, float)):
                    self.phase.labels(self.rank, phase).set(value)

    def failed(self, operation: str, error: str, seconds: float) -> None:
        self.ops.labels(self.rank, operation, "error").inc()
        self.failures.labels(self.rank, operation, error).inc()
        self.seconds.labels(self.rank, operation).observe(seconds)
        self.running.labels(self.rank).set(0)

    def render(self) -> bytes:
        return _prom.generate_latest(self.registry)


def make_metrics(rank: int) -> Metrics | None:
    """A :class:`Metrics` for ``rank``, or ``None`` when prometheus-client is not installed."""
    return Metrics(rank) if _prom is not None else None
