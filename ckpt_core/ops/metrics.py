"""Prometheus metrics of one parameter-server rank (optional: needs ``prometheus-client``).

Each :class:`Metrics` owns its own registry, so two services in one process (tests) never
collide and nothing leaks into the process-wide default registry. Without
``prometheus-client`` installed, :func:`make_metrics` returns ``None`` and the service answers
``/metrics`` with 501 naming the missing package.

Exported series (all carry the label ``rank``):

- ``ckpt_operations_total{operation, outcome}``: register/unregister/gather/update/load_metas calls;
  outcome ``ok``, ``error`` (ours or a peer's: HTTP 5xx) or ``rejected`` (the client's: HTTP 4xx)
- ``ckpt_operation_failures_total{operation, error}``: failures (not rejections) by ``ckpt_core.errors`` class
- ``ckpt_operation_seconds{operation}``: histogram of durations
- ``ckpt_update_bytes_total``: bytes THIS rank moved in successful updates (its own share, copied from
  its host memory and broadcast); a sum over ranks is the model bytes, once per update
- ``ckpt_updates_by_kind_total{kind}``: successful updates, ``full``, ``delta`` (only what changed since
  the version's base, docs/deltas.md) or ``fallback`` (a delta refused, then the full version sent)
- ``ckpt_delta_payload_bytes_total``: bytes of THIS rank's delta payloads in successful delta updates,
  and ``ckpt_delta_full_bytes_total``: what the same versions' full updates would have moved from
  this rank; their ratio is what deltas save
- ``ckpt_last_update_phase_seconds{phase}``: per-phase timings of the last successful update
- ``ckpt_last_success_timestamp_seconds{operation}``: unix time of the last success of each operation
- ``ckpt_checkpoint_info{checkpoint, weight_version}``: 1 for the checkpoint of the last successful update
- ``ckpt_registered_bytes``: host bytes of the checkpoints registered on this rank now
- ``ckpt_healthy``: 1 while ``/v1/healthz`` answers 200, else 0
- ``ckpt_operation_running``: 1 while a long operation runs
- ``ckpt_requests_refused_total{status, error}``: every 4xx answer of the service, whatever refused it
  (the bearer token 401, the policy 403, validation 422, a route's own 4xx): refusals outside a long
  operation (401, 422 of a body) are counted here only
"""

from __future__ import annotations

from ckpt_core.errors import ConfigError

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
        self.update_bytes = _prom.Counter("ckpt_update_bytes", "Bytes this rank moved in successful updates (its "
                                          "own share: a sum over ranks counts each model byte once)",
                                          ["rank"], registry=reg)
        self.kinds = _prom.Counter("ckpt_updates_by_kind", "Successful updates: full, delta or fallback",
                                   ["rank", "kind"], registry=reg)
        self.delta_payload = _prom.Counter("ckpt_delta_payload_bytes", "Bytes of this rank's delta payloads in "
                                           "successful delta updates", ["rank"], registry=reg)
        self.delta_full = _prom.Counter("ckpt_delta_full_bytes", "Bytes the same versions' full updates would have "
                                        "moved from this rank", ["rank"], registry=reg)
        self.phase = _prom.Gauge("ckpt_last_update_phase_seconds", "Phases of the last successful update",
                                 ["rank", "phase"], registry=reg)
        self.running = _prom.Gauge("ckpt_operation_running", "1 while a long operation runs", ["rank"], registry=reg)
        self.last_success = _prom.Gauge("ckpt_last_success_timestamp_seconds",
                                        "Unix time of the last successful operation", ["rank", "operation"],
                                        registry=reg)
        self.info = _prom.Gauge("ckpt_checkpoint_info", "1 for the checkpoint (and weight version) of the last "
                                "successful update", ["rank", "checkpoint", "weight_version"], registry=reg)
        self.registered = _prom.Gauge("ckpt_registered_bytes", "Host bytes of the checkpoints registered on this rank",
                                      ["rank"], registry=reg)
        self.healthy = _prom.Gauge("ckpt_healthy", "1 while /v1/healthz answers 200, else 0", ["rank"], registry=reg)
        self.refused = _prom.Counter("ckpt_requests_refused", "4xx answers of the service by status and error type",
                                     ["rank", "status", "error"], registry=reg)

    def sample_with(self, registered, healthy) -> None:
        """Callables read at each scrape (states, not events): ``registered() -> bytes``, ``healthy() -> bool``."""
        self.registered.labels(self.rank).set_function(registered)
        self.healthy.labels(self.rank).set_function(lambda: 1.0 if healthy() else 0.0)

    def started(self) -> None:
        self.running.labels(self.rank).set(1)

    def succeeded(self, operation: str, seconds: float, nbytes: int | None, update: dict | None,
                  weight_version: str | None = None) -> None:
        self.ops.labels(self.rank, operation, "ok").inc()
        self.seconds.labels(self.rank, operation).observe(seconds)
        self.running.labels(self.rank).set(0)
        self.last_success.labels(self.rank, operation).set_to_current_time()
        if update is not None:
            # h2d_bytes: what this rank staged from its own host memory (its share); a P2P update's
            # figures have no share, and a rank that received only moved nothing of its own.
            self.update_bytes.labels(self.rank).inc(update.get("h2d_bytes") or 0)
            self._count_kind(update.get("delta"))
            for phase, value in (update.get("seconds") or {}).items():
                if isinstance(value, (int, float)):
                    self.phase.labels(self.rank, phase).set(value)
            self.info.clear()
            self.info.labels(self.rank, str(update.get("name", "")), weight_version or "").set(1)

    def _count_kind(self, delta) -> None:
        """The kind of a successful update from its ``delta`` figures (absent: a full update)."""
        if not isinstance(delta, dict):
            self.kinds.labels(self.rank, "full").inc()
        elif "fallback" in delta:
            self.kinds.labels(self.rank, "fallback").inc()
        else:
            self.kinds.labels(self.rank, "delta").inc()
            self.delta_payload.labels(self.rank).inc(int(delta.get("payload_bytes") or 0))
            self.delta_full.labels(self.rank).inc(int(delta.get("full_bytes") or 0))

    def failed(self, operation: str, error: str, seconds: float, *, rejected: bool = False) -> None:
        self.ops.labels(self.rank, operation, "rejected" if rejected else "error").inc()
        if not rejected:
            self.failures.labels(self.rank, operation, error).inc()
        self.seconds.labels(self.rank, operation).observe(seconds)
        self.running.labels(self.rank).set(0)

    def refused_request(self, status: int, error: str) -> None:
        self.refused.labels(self.rank, str(status), error).inc()

    def render(self) -> bytes:
        return _prom.generate_latest(self.registry)

    def serve_on(self, port: int, addr: str = "127.0.0.1"):
        """Serve this registry (``GET /metrics`` and ``/``) on ``addr:port`` in a daemon thread; returns
        the server (``.server_address``, ``.shutdown()``). For Prometheus, which cannot scrape a Unix socket."""
        try:
            server, _thread = _prom.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc}") from exc
        return server


def make_metrics(rank: int) -> Metrics | None:
    """A :class:`Metrics` for ``rank``, or ``None`` when prometheus-client is not installed."""
    return Metrics(rank) if _prom is not None else None
