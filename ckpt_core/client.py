"""A Python client for a world of ``ckpt-engine serve`` ranks: one call, every rank, typed errors.

Each PS rank runs its own HTTP service (``ckpt-engine serve``; docs/operations.md). Registering,
gathering and updating are collectives: every rank's service must be asked at once, and a
controller otherwise writes that fan-out itself. ``ServiceWorld`` does it::

    from ckpt_core.client import ServiceWorld

    with ServiceWorld.from_template("/run/ckpt/ps-{rank}.sock", world_size=8) as world:
        world.register("step-7", "/ckpt/step-7")          # each rank its share of the directory
        world.gather_metas("step-7")
        result = world.update("step-7", update_url="http://127.0.0.1:8000/collective_rpc")
        world.unregister("step-6", missing_ok=True)

Endpoints are Unix socket paths (``/run/ckpt/ps-0.sock`` or ``unix:/run/...``, the service's default)
or ``http(s)://host:port`` URLs. ``token``: the bearer token of services started with one (every TCP
service; a Unix-socket service too when ``CKPT_SERVICE_TOKEN`` or ``--token-file`` was set). Errors: when any rank
answers an error, the call raises the ``ckpt_core.errors`` class of the first failing rank's answer
(``ConfigError`` for a refused request: 4xx validation, auth or policy), its message naming every
failing rank with its HTTP status, type and message; ``.ranks`` holds each failing rank's error body.
A rank that cannot be reached raises ``TransportError`` naming its endpoint and the cause. Every
request has a timeout: an update's own ``timeout`` plus ``margin_s``.

Needs only httpx (a dependency of the core), not the ``server`` extra; importing it imports no torch
(registering a directory does, to split it between ranks by its safetensors headers: give one list of
files per rank to avoid that).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import httpx

from ckpt_core import errors
from ckpt_core.engines.http import HttpTransport

__all__ = ["ServiceWorld", "env_token"]

_REFUSALS = {"ValidationError", "Unauthorized", "Forbidden", "Conflict", "NotFound", "PayloadTooLarge"}
# update fields that only a rank posting to an engine takes (the service refuses them without update_url)
_POSTING_OPTIONS = ("stage", "stage_device_gib", "prepare")


def env_token() -> str | None:
    """The bearer token the services of this host were started with, as their environment gives it
    (``CKPT_SERVICE_TOKEN``; None when unset or empty): for a ``ServiceWorld`` in the same environment."""
    from ckpt_core._settings import service_token

    return service_token()


def _client(endpoint: str, timeout: float) -> HttpTransport:
    """One rank's connection: ``engines.http.HttpTransport``, which sends a request again on a fresh
    connection when the pooled one it went out on was closed by the service before any answer (an idle
    keep-alive connection the server was closing as the request left: without it one rank's update could
    fail with "server disconnected" while the others waited in the update's collective). The connect
    timeout is the request's: a service busy in a long call may accept late."""
    if endpoint.startswith(("http://", "https://")):
        return HttpTransport(endpoint, timeout=timeout, connect_timeout=timeout)
    path = endpoint.removeprefix("unix://").removeprefix("unix:")
    if not path.startswith("/"):
        raise errors.ConfigError(f"endpoint {endpoint!r}: give a Unix socket path (/run/...sock) or an http(s) URL")
    return HttpTransport("http://ps", uds=path, timeout=timeout, connect_timeout=timeout)


def _error_of(rank: int, answer: httpx.Response) -> dict:
    try:
        body = answer.json()["error"]
        if not isinstance(body, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        body = {"type": "HTTPError", "message": answer.text[:500] or answer.reason_phrase}
    return {**body, "rank": rank, "status": answer.status_code}


def _raise_for(method: str, path: str, failed: list[dict]) -> None:
    first = failed[0]
    kind = first.get("type", "")
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CkptError)):   # the service's own refusals
        cls = errors.ConfigError if kind in _REFUSALS or 400 <= first["status"] < 500 else errors.TransportError
    lines = "; ".join(f"rank {e['rank']}: {e['status']} {e.get('type')}: {str(e.get('message', '')).strip()}"
                      for e in failed)
    exc = cls(f"{method} {path} failed: {lines}")
    exc.ranks = {e["rank"]: e for e in failed}  # type: ignore[attr-defined]  # on whichever class the service named
    raise exc


class ServiceWorld:
    """The services of one PS world, rank 0 first. Calls go to every rank at once unless noted."""

    def __init__(self, endpoints: Sequence[str], *, token: str | None = None, timeout: float = 600.0,
                 margin_s: float = 30.0):
        if not endpoints:
            raise errors.ConfigError("ServiceWorld needs one endpoint per rank, got none")
        if not 0 < timeout <= 7 * 24 * 3600 or not 0 <= margin_s <= 3600:
            raise errors.ConfigError(f"timeout {timeout!r} s / margin_s {margin_s!r} s out of range")
        self.endpoints, self.timeout, self.margin_s = list(endpoints), float(timeout), float(margin_s)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._clients = [_client(e, self.timeout + self.margin_s) for e in self.endpoints]
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(len(self._clients), thread_name_prefix="ckpt-world")

    @classmethod
    def from_template(cls, template: str, world_size: int, **kwargs) -> "ServiceWorld":
        """``template`` with ``{rank}`` filled in for ranks 0 .. world_size - 1."""
        if "{rank}" not in template or not 0 < world_size <= 65536:
            raise errors.ConfigError(f"from_template needs '{{rank}}' in {template!r} and 1..65536 ranks, "
                                     f"got {world_size!r}")
        return cls([template.format(rank=r) for r in range(world_size)], **kwargs)

    @property
    def world_size(self) -> int:
        return len(self.endpoints)

    # -- the fan-out ---------------------------------------------------------------------------------

    def _one(self, rank: int, method: str, path: str, body: Any = None, params=None, timeout=None) -> httpx.Response:
        kw: dict[str, Any] = {"params": params, "headers": self._headers}
        if body is not None:
            kw["json"] = body
        wait = (self.timeout if timeout is None else timeout) + self.margin_s
        try:
            return self._clients[rank].request(method, path, timeout=wait, **kw)
        except errors.UpdateTimeoutError as exc:
            raise errors.UpdateTimeoutError(f"rank {rank} ({self.endpoints[rank]}) did not answer {method} {path} "
                                            f"within {wait:.0f} s ({exc})") from exc
        except errors.TransportError as exc:
            raise errors.TransportError(f"rank {rank} ({self.endpoints[rank]}) unreachable on {method} {path}: "
                                        f"{exc}") from exc

    def call(self, method: str, path: str, bodies: Sequence[Any] | None = None, *, ranks: Sequence[int] | None = None,
             params: Mapping | None = None, timeout: float | None = None, ok_status: tuple[int, ...] = ()) -> list:
        """``method path`` on ``ranks`` (all) at once, ``bodies[i]`` to the i-th; each rank's ``result``.
        Answers whose status is in ``ok_status`` count as success (their result is None)."""
        if self._pool is None:
            raise errors.ClosedError("ServiceWorld is closed")
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        if bodies is not None and len(bodies) != len(ranks):
            raise errors.ConfigError(f"{len(bodies)} request bodies for {len(ranks)} ranks")
        futures = [self._pool.submit(self._one, r, method, path, None if bodies is None else bodies[i], params, timeout)
                   for i, r in enumerate(ranks)]
        answers, unreachable = [], None
        for f in futures:   # wait for every rank before raising: no request is left running behind us
            try:
                answers.append(f.result())
            except errors.CkptError as exc:
                answers.append(None)
                unreachable = unreachable or exc
        if unreachable is not None:
            raise unreachable
        failed = [_error_of(r, a) for r, a in zip(ranks, answers)
                  if a.status_code != 200 and a.status_code not in ok_status]
        if failed:
            _raise_for(method, path, failed)
        return [a.json().get("result") if a.status_code == 200 else None for a in answers]

    # -- the service's operations ----------------------------------------------------------------------

    def register(self, name: str, files: str | Sequence[Sequence[str]], *, use_shared_memory_pool: bool = False,
                 use_inplace_pin_memory: bool = True, base: str | None = None) -> list:
        """Register ``name``: ``files`` is a checkpoint directory (each rank its share, as
        ``split_checkpoint_files``) or one list of safetensors files per rank. ``base``: a checkpoint
        registered before, the version the engines hold: each rank also encodes its share's delta
        against it, for updates with ``delta`` (docs/deltas.md); each rank's share of both must hold
        the same tensors."""
        if isinstance(files, str):   # imported here: it reads safetensors headers, with torch's dtypes
            from ckpt_core.checkpoint.sources import split_checkpoint_files
            shares = [split_checkpoint_files(files, r, self.world_size) for r in range(self.world_size)]
        else:
            shares = [list(s) for s in files]
        if len(shares) != self.world_size:
            raise errors.ConfigError(f"{len(shares)} file lists for {self.world_size} ranks")
        opts = {"use_shared_memory_pool": use_shared_memory_pool, "use_inplace_pin_memory": use_inplace_pin_memory,
                **({"base": base} if base is not None else {})}
        return self.call("POST", f"/v1/checkpoints/{name}/files", [{"files": s, **opts} for s in shares])

    def gather_metas(self, name: str) -> None:
        self.call("POST", f"/v1/checkpoints/{name}/gather-metas")

    def update(self, name: str, *, update_url: str | Mapping[int, str] | None = None, timeout: float = 300.0,
               **options: Any) -> dict:
        """Update every rank from ``name``; rank 0's result (bytes, seconds, ...).

        ``update_url``: the engine's URL (vLLM's ``/collective_rpc``, or the SGLang server's with
        ``engine="sglang"``), posted by rank 0; or ``{rank: url}`` where several engines are fed (each
        engine's first rank). ``options`` are the service's update fields (``engine``, ``ranks``,
        ``inference_group_ranks``, ``uds``, ``slices``, ``delta``, ``deltas``, ``stage``, ``prepare``,
        ``stage_device_gib``, ``weight_version``, ``flush_cache``), sent to every rank alike, except
        those of a staged update (``stage``, ``stage_device_gib``, ``prepare``): to the ranks that post
        (with ``update_url``) only, the others post nothing to stage.

        A sliced delta: ``update(name, update_url=url, slices=True, delta=True)`` (staged: ``stage(name,
        name, update_url=url, slices=True, delta=True)``, then ``commit(name, update_url=url)``)."""
        urls = {0: update_url} if isinstance(update_url, str) else dict(update_url or {})
        if any(r not in range(self.world_size) for r in urls):
            raise errors.ConfigError(f"update_url for ranks {sorted(urls)} of a world of {self.world_size}")
        posting = {k: options.pop(k) for k in _POSTING_OPTIONS if k in options}
        bodies = [{"timeout": timeout, **options, **({"update_url": urls[r], **posting} if r in urls else {})}
                  for r in range(self.world_size)]
        return self.call("POST", f"/v1/checkpoints/{name}/update", bodies, timeout=timeout)[0]

    def stage(self, name: str, version: str, **kwargs: Any) -> dict:
        """Stage ``name`` as ``version`` while the engine keeps serving; ``commit`` makes it live."""
        return self.update(name, stage=version, **kwargs)

    def commit(self, version: str, *, update_url: str, rank: int = 0, timeout: float = 300.0, **options: Any) -> dict:
        """Make the staged ``version`` live on the engine at ``update_url`` (one rank's service
        asks; ``options``: ``engine``, ``pause``, ``uds``)."""
        body = {"version": version, "update_url": update_url, "timeout": timeout, **options}
        return self.call("POST", "/v1/commit", [body], ranks=[rank], timeout=timeout)[0]

    def unregister(self, name: str, *, force: bool = False, missing_ok: bool = False) -> None:
        """Drop ``name`` on every rank (``missing_ok``: a rank that does not hold it is fine)."""
        self.call("DELETE", f"/v1/checkpoints/{name}", params={"force": str(force).lower()},
                  ok_status=(404,) if missing_ok else ())

    def status(self) -> list[dict]:
        """Each rank's ``GET /v1/status``."""
        return [self._json(r, "/v1/status") for r in range(self.world_size)]

    def checkpoints(self) -> set[str]:
        """The checkpoints any rank holds."""
        return {n for s in self.status() for n in s["checkpoints"]}

    def problems(self) -> dict[int, str]:
        """Ranks whose ``/v1/healthz`` is not ok, with the reason (unreachable ranks too)."""
        out = {}
        for r in range(self.world_size):
            try:
                answer = self._one(r, "GET", "/v1/healthz")
            except errors.CkptError as exc:
                out[r] = str(exc)
                continue
            if answer.status_code != 200:
                out[r] = f"{answer.status_code} {_error_of(r, answer).get('message')}"
        return out

    def check_healthy(self) -> None:
        """Raise ``TransportError`` naming every unhealthy rank (the world must then be restarted)."""
        bad = self.problems()
        if bad:
            raise errors.TransportError("unhealthy PS ranks: " + "; ".join(f"rank {r}: {p}" for r, p in bad.items()))

    def _json(self, rank: int, path: str) -> dict:
        answer = self._one(rank, "GET", path)
        if answer.status_code != 200:
            _raise_for("GET", path, [_error_of(rank, answer)])
        return answer.json()

    def close(self) -> None:
        """Close every connection; idempotent."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=True)
        self._pool = None
        for c in self._clients:
            c.close()

    def __enter__(self) -> "ServiceWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
