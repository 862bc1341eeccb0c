"""The FastAPI application of one parameter-server rank.

Routes (the first seven are the reference checkpoint-engine's, same paths and fields; the update
route adds ``engine`` (``vllm``/``sglang``), ``weight_version``, ``flush_cache``, ``stage``/``prepare``
and ``slices``, ``_models.UpdateRequest``):

| route | does | collective |
|---|---|---|
| ``POST /v1/checkpoints/{name}/files`` | ``register_checkpoint(name, files=...)`` | no |
| ``DELETE /v1/checkpoints/{name}`` | ``unregister_checkpoint(name)`` | no |
| ``POST /v1/checkpoints/{name}/gather-metas`` | ``gather_metas(name)`` | yes: post to every rank |
| ``POST /v1/checkpoints/{name}/update`` | ``update(name, ...)`` | yes: post to every rank |
| ``GET /v1/healthz`` | 200 while the rank can work, 503 once closed or broken | |
| ``GET /v1/metas``, ``POST /v1/metas`` | ``get_metas()``, ``load_metas(...)`` | no |
| ``GET /v1/status`` | checkpoints, the running operation and its phase, last results | |
| ``GET /metrics`` | Prometheus text | |

Errors: every 4xx/5xx body is ``{"error": {"type", "message", ...}}`` (:class:`ErrorBody`), bounded
in size (``_state.clip``), unknown routes and methods included (404 ``NotFound``, 405
``MethodNotAllowed``). ``Forbidden`` 403 (a file or engine endpoint outside the operator's
allow-lists, ``_policy.py``), ``ConfigError`` 400, ``CheckpointNotFoundError`` 404, a second long
operation 409, ``CheckpointFormatError`` 422, request validation 422, ``RemoteWorkerError`` 502,
``ClosedError`` 503, ``UpdateTimeoutError`` 504, any other error 500 (its class in ``type``).

No ``/docs`` page: FastAPI's loads its scripts from a public CDN, which air-gapped clusters cannot
reach; ``/openapi.json`` is the schema.
"""

from __future__ import annotations

import hmac
import os
from functools import partial
from typing import Any, Optional
from urllib.parse import urlsplit

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckpt_core.ops import metrics as _metrics
from ckpt_core.engines.requests import request_inference_to_update
from ckpt_core.errors import CkptError, ConfigError
from ckpt_core._settings import MIN_TOKEN_CHARS, slices_enabled
from ckpt_core.ops.log import rank_logger
from ._policy import ServicePolicy
from ._models import MAX_DETAILS, NAME_PATTERN, CommitRequest, Done, ErrorBody, RegisterRequest, Status, UpdateRequest
from ._state import Busy, ServiceState, clip, error_fields, status_of

SGLANG_ROUTE = "/update_weights_from_ipc"
_ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 403, 404, 405, 409, 422, 500, 502, 503, 504)}
_HTTP_TYPES = {404: "NotFound", 405: "MethodNotAllowed", 413: "PayloadTooLarge"}


def _error(code: int, type_: str, message: str, **extra) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": clip(message), **extra}}, status_code=code)


def create_app(ps, *, token: str | None = None, metrics=None, policy: ServicePolicy | None = None) -> FastAPI:
    """The service of ``ps`` (one ``ParameterServer`` rank). ``app.state.service`` owns its worker
    thread; whoever serves the app calls ``app.state.service.close()`` when done (``serve`` does).

    ``token``: when set, every request must carry ``Authorization: Bearer <token>`` (compared in
    constant time); otherwise 401. ``metrics``: a :class:`ckpt_core.ops.metrics.Metrics` (default:
    one for this rank when prometheus-client is installed). ``policy``: the files and engine endpoints
    requests may name (default ``ServicePolicy()``: no files, loopback engines, no engine sockets).
    """
    state = ServiceState(ps, metrics if metrics is not None else _metrics.make_metrics(ps.rank))
    app = FastAPI(title="ckpt-engine parameter server", version="1", responses=_ERRORS,
                  description="One parameter-server rank; see docs/operations.md", docs_url=None, redoc_url=None)
    app.state.service = state
    if state.metrics is not None:
        state.metrics.sample_with(lambda: _registered_bytes(ps), lambda: _health_problem(state, ps) is None)
    chained = ps.progress   # e.g. a terminal progress bar or a progress log set by `ckpt-engine serve`
    if chained is not None and getattr(chained, "describe", False) is None:
        chained.describe = state.describe   # a LogProgress's start line names the checkpoint and its bytes

    def progress(operation, phase, done, total):
        state.set_phase(phase, done, total)
        if chained is not None:
            chained(operation, phase, done, total)
    ps.progress = progress
    _install_errors(app)
    if token is not None:
        _install_auth(app, token)
    _routes(app, state, ps, policy if policy is not None else ServicePolicy())
    return app


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(CkptError)
    async def on_ckpt_error(request: Request, exc: CkptError):
        return JSONResponse({"error": error_fields(exc)}, status_code=status_of(exc))

    @app.exception_handler(Busy)
    async def on_busy(request: Request, exc: Busy):
        return _error(409, "Conflict", str(exc))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()   # never echoed whole: a 100,000-item body has as many errors
        details = [{"loc": [clip(str(x), 200) for x in e.get("loc", ())][:8], "msg": clip(str(e.get("msg", "")), 300),
                    "type": str(e.get("type", ""))[:100]} for e in errors[:MAX_DETAILS]]
        where = "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in details[:5])
        more = f" (and {len(errors) - MAX_DETAILS} more)" if len(errors) > MAX_DETAILS else ""
        return _error(422, "ValidationError", f"invalid request: {where}{more}", details=details)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404:
            detail = f"no route {request.url.path[:200]!r} (see /openapi.json)"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path[:200]!r} (see /openapi.json)"
        resp = _error(exc.status_code, _HTTP_TYPES.get(exc.status_code, "HTTPError"), detail)
        for key, value in (exc.headers or {}).items():
            resp.headers[key] = value
        return resp

    @app.exception_handler(Exception)
    async def on_other(request: Request, exc: Exception):
        return JSONResponse({"error": error_fields(exc)}, status_code=500)


def check_token(token: str | None) -> None:
    """ConfigError unless ``token`` is long enough to resist guessing (:data:`MIN_TOKEN_CHARS`)."""
    if token is None or len(token) < MIN_TOKEN_CHARS or token != token.strip():
        raise ConfigError(f"the bearer token must be at least {MIN_TOKEN_CHARS} characters without surrounding "
                          f"spaces, got {0 if token is None else len(token)} (e.g. `openssl rand -hex 16`)")


def _install_auth(app: FastAPI, token: str) -> None:
    check_token(token)
    want = token.encode()

    @app.middleware("http")
    async def bearer(request: Request, call_next):
        # RFC 7235: the scheme is case-insensitive ("bearer", "BEARER"); the token is compared exactly.
        scheme, _, got = request.headers.get("authorization", "").strip().partition(" ")
        got = got.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(got, want):
            resp = _error(401, "Unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)")
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        return await call_next(request)


def _check_name(name: str) -> str:
    import re
    if not re.fullmatch(NAME_PATTERN, name):
        raise ConfigError(f"checkpoint name {name[:80]!r} is not allowed (1-256 characters, no '/' or control characters)")
    return name


def _req_func(body: UpdateRequest, world_size: int, wire: str, policy: ServicePolicy):
    """The ``req_func`` of one update: post the chosen handles to ``update_url`` (if any); ``plan``: the
    slice plan the update routes by (``slices``), whose digest the engine's workers are told.

    ``engine="vllm"``: ``request_inference_to_update`` (``/collective_rpc``). ``engine="sglang"``:
    ``ckpt_sglang.SglangClient.update`` (``/update_weights_from_ipc``), which needs a PS speaking
    the stock wire (SGLang embeds the stock worker): refused up front on a native-wire service.
    """
    bad = [r for r in body.inference_group_ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"inference_group_ranks {bad} are outside this world of {world_size} ranks")
    if body.engine == "sglang" and wire == "native":
        raise ConfigError("engine='sglang' needs a parameter server speaking the stock wire (SGLang embeds the "
                          "stock checkpoint-engine worker): start the service with `ckpt-engine serve --wire stock` "
                          "(`--wire stock-0.3` for checkpoint-engine 0.2.1 - 0.3.4 in the server)")
    if body.uds is not None and body.update_url is None:
        raise ConfigError("uds is the socket to reach update_url by: give update_url too")
    uds = None
    if body.update_url is not None:   # before anything is posted: only to engines the operator allowed
        uds = policy.check_engine(body.update_url, body.uds, body.engine)
    sglang_base = _sglang_base(body.update_url) if body.engine == "sglang" and body.update_url else None

    def req_func(handles, plan=None):
        if body.update_url is None:
            return None
        chosen = [handles[r] for r in body.inference_group_ranks] if body.inference_group_ranks else handles
        sliced = {"slices": plan.digest} if plan is not None else {}
        if body.stage is not None:
            with _engine_client(body.engine, body.update_url, uds, body.timeout) as client:
                extra = {"prepare": True} if body.prepare else {}
                client.stage(chosen, body.stage, device_bytes=int(body.stage_device_gib * (1 << 30)), **extra,
                             **sliced)
            return None
        if sliced:   # our worker extension's own route takes the plan's digest
            with _engine_client(body.engine, body.update_url, uds, body.timeout) as client:
                client.update(chosen, **sliced)
            return None
        if sglang_base is None:
            request_inference_to_update(body.update_url, dict(chosen), timeout=body.timeout, uds=uds)
            return None
        from ckpt_sglang import SglangClient
        with SglangClient(sglang_base, uds=uds, timeout=body.timeout) as client:
            client.update(chosen, flush_cache=body.flush_cache, weight_version=body.weight_version)
    return req_func


_SLICES_OFF_SAID: list = []   # the CKPT_SLICES=0 warning, once per process
_ENGINE_PLANS: dict = {}   # update_url -> the slice plan its workers were last given (VllmClient.slice_plan(reuse=))


def _update(ps, name: str, body: UpdateRequest, policy: ServicePolicy, req_func) -> dict:
    """The collective update of one request, by a slice plan shared first when it asks for ``slices``
    (and the operator did not turn slices off, ``CKPT_SLICES=0``: then whole, said once)."""
    if body.slices and not slices_enabled():
        if not _SLICES_OFF_SAID:
            _SLICES_OFF_SAID.append(True)
            rank_logger(f"service rank {ps.rank}/{ps.world_size}").warning(
                "phase=update checkpoint=%s slices were asked for, but CKPT_SLICES=0 turns them off: whole tensors", name)
        body = body.model_copy(update={"slices": False})
    if body.slices and ps.wire != "native":   # every rank's service has the same wire: all refuse, none waits
        raise ConfigError(f"slices need a parameter server speaking our own wire; this one speaks {ps.wire!r}")
    plan = _slice_plan(ps, name, body, policy) if body.slices else None
    return ps.update(name, partial(req_func, plan=plan), ranks=body.ranks or None, timeout=body.timeout, slices=plan)


def _slice_plan(ps, name: str, body: UpdateRequest, policy: ServicePolicy):
    """Collective, before a sliced update: the ranks whose request gives ``update_url`` record the plan
    from that engine's workers (``VllmClient.slice_plan``: recorded once per model, layout and vLLM
    version, then installed on the workers), and every rank gets the lowest such rank's. A rank that
    could not record it fails every rank, naming it, before anything moves."""
    recorded, error = None, None
    if body.update_url is not None:
        try:
            uds = policy.check_engine(body.update_url, body.uds, body.engine)
            with _engine_client(body.engine, body.update_url, uds, body.timeout) as client:
                # The engine's plan of the last update is kept while its workers hold it (no re-recording).
                recorded = _ENGINE_PLANS[body.update_url] = client.slice_plan(
                    ps.tensor_specs(name), reuse=_ENGINE_PLANS.get(body.update_url))
        except CkptError as exc:   # said on every rank (the others would wait in the exchange)
            error = f"{type(exc).__name__}: {exc}"
    return ps.share_slice_plan(recorded, src=None, error=error)


def _vllm_base(url: str) -> str:
    """``http://host:port`` of a vLLM ``/collective_rpc`` URL (the policy checked its path)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/collective_rpc')}"


def _engine_client(engine: str, update_url: str, uds: str | None, timeout: float):
    """The requester of a staged update's engine (``update_url`` already checked by the policy)."""
    if engine == "sglang":
        from ckpt_sglang import SglangClient
        return SglangClient(_sglang_base(update_url), uds=uds, timeout=timeout)
    from ckpt_vllm.client import VllmClient
    return VllmClient(_vllm_base(update_url), uds=uds, timeout=timeout)


def _commit(body, policy: ServicePolicy) -> dict:
    """``POST /v1/commit``: the engine's staged version made live (see ``CommitRequest``)."""
    uds = policy.check_engine(body.update_url, body.uds, body.engine)
    with _engine_client(body.engine, body.update_url, uds, body.timeout) as client:
        report = client.commit(body.version, pause=body.pause, timeout=body.timeout)
    return {"version": body.version, "seconds": report.seconds, "workers": report.workers}


def _sglang_base(url: str) -> str:
    """The SGLang server's base URL from ``update_url`` (``http://host:port``, optionally with its route)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ConfigError(f"update_url for engine='sglang' must be the server's URL (http://host:port), "
                          f"got {url[:200]!r}")
    path = parts.path.rstrip("/").removesuffix(SGLANG_ROUTE)
    return f"{parts.scheme}://{parts.netloc}{path}"


def _routes(app: FastAPI, state: ServiceState, ps, policy: ServicePolicy) -> None:
    @app.post("/v1/checkpoints/{name}/files", response_model=Done)
    async def register_files(name: str, body: RegisterRequest):
        _check_name(name)
        files = policy.check_files(body.files)   # before any file is opened: 403 outside --allow-dir

        def register():
            _check_host_memory(ps, files, body)   # before any memory is taken: 400 naming both sizes
            ps.register_checkpoint(name, files=files, use_shared_memory_pool=body.use_shared_memory_pool,
                                   use_inplace_pin_memory=body.use_inplace_pin_memory)
        await state.run("register", name, register, nbytes=_file_bytes(files))
        return Done(result=ps.last_register)

    @app.delete("/v1/checkpoints/{name}", response_model=Done)
    async def unregister(name: str, force: bool = Query(False)):
        await state.run("unregister", name, lambda: ps.unregister_checkpoint(name, force=force))
        return Done()

    @app.post("/v1/checkpoints/{name}/gather-metas", response_model=Done)
    async def gather_metas(name: str):
        _check_name(name)
        await state.run("gather", name, lambda: ps.gather_metas(name))
        return Done()

    @app.post("/v1/checkpoints/{name}/update", response_model=Done)
    async def update(name: str, body: Optional[UpdateRequest] = Body(default=None)):
        _check_name(name)
        body = body if body is not None else UpdateRequest()   # every field has a default: no body is fine
        req_func = _req_func(body, ps.world_size, ps.wire, policy)
        result = await state.run("update", name, lambda: _update(ps, name, body, policy, req_func),
                                 nbytes=_registered_bytes(ps, name), weight_version=body.weight_version)
        return Done(result=result)

    @app.post("/v1/commit", response_model=Done)
    async def commit(body: CommitRequest):
        result = await state.run("commit", body.version, lambda: _commit(body, policy), weight_version=body.version)
        return Done(result=result)

    @app.get("/v1/healthz")
    async def healthz():
        problem = _health_problem(state, ps)
        if problem:
            return _error(503, "Unhealthy", problem)
        return {"status": "ok"}

    @app.get("/v1/metas", response_model=dict[str, Any])
    async def get_metas():
        """The versioned metas document of ``ParameterServer.get_metas()`` (see ckpt_core.p2p.metas)."""
        return ps.get_metas()

    @app.post("/v1/metas", response_model=Done)
    async def load_metas(metas: dict[str, Any]):
        """Install a document from ``GET /v1/metas``; the PS validates it whole (400 when malformed)."""
        await state.run("load_metas", None, lambda: ps.load_metas(metas))
        return Done()

    @app.get("/v1/status", response_model=Status)
    async def status():
        return Status(rank=ps.rank, world_size=ps.world_size, pid=os.getpid(), device_key=ps.device_uuid, wire=ps.wire,
                      checkpoints=ps.checkpoints(), gathered=sorted(getattr(ps, "_metas", {})),
                      running=state.snapshot(),
                      updates=state.updates, failures=state.failures, last_update=ps.last_update,
                      last_register=ps.last_register, last_error=state.last_error,
                      last_success_unix=dict(state.last_success), registered_bytes=_registered_bytes(ps),
                      healthy=_health_problem(state, ps) is None, problem=_health_problem(state, ps),
                      peers=state.liveness.peers() if state.liveness is not None else None)

    @app.get("/metrics", include_in_schema=True, response_class=Response)
    async def metrics():
        if state.metrics is None:
            return _error(501, "NotImplemented", "Prometheus metrics need prometheus-client: "
                          "pip install 'ckpt-engine[server]'")
        return Response(state.metrics.render(), media_type=_metrics.CONTENT_TYPE)


def _health_problem(state: ServiceState, ps) -> str | None:
    if state.closed or getattr(ps, "_closed", False):
        return "this parameter server is closed"
    broken = getattr(ps, "_broken", None)
    if broken:
        return clip(f"process groups broke in an earlier update ({broken}); restart this world")
    if state.liveness is not None:
        return state.liveness.problem()   # a peer rank (or the rendezvous store) went silent
    return None


def _registered_bytes(ps, name: str | None = None) -> int | None:
    """Host bytes of checkpoint ``name`` (None: all of them) registered on this rank."""
    ckpts = getattr(ps, "_checkpoints", {})
    if name is not None:
        return ckpts[name].nbytes if name in ckpts else None
    return sum(c.nbytes for c in ckpts.values())


def _file_bytes(files: list[str]) -> int | None:
    """Sizes of ``files`` on disk (the registration's start line); None when one cannot be read."""
    try:
        return sum(os.path.getsize(f) for f in files)
    except OSError:
        return None


def _check_host_memory(ps, files: list[str], body: RegisterRequest) -> None:
    """The host memory a registration of ``files`` will take, checked against what the host has. Files
    mapped in place (/dev/shm) take none; a shared pool already large enough takes none."""
    from ckpt_core.checkpoint.safetensors import read_header
    from ckpt_core.planning.capacity import check_host_memory, host_memory_available
    needed = 0
    for f in files:
        if body.use_inplace_pin_memory and f.startswith("/dev/shm/"):
            continue
        try:
            header = read_header(f)
        except OSError:
            continue   # the registration names it (400)
        needed += header.file_size - header.data_offset
    pool = getattr(getattr(ps, "_pool", None), "region", None) if body.use_shared_memory_pool else None
    if pool is not None and pool.nbytes >= needed:
        return
    check_host_memory(needed, host_memory_available(), what=f"registering {len(files)} file(s) on rank {ps.rank}")
