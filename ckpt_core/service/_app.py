"""The FastAPI application of one parameter-server rank.

Routes (the first seven are the reference checkpoint-engine's, same paths and fields; the update
route adds ``engine`` (a name of the ``ckpt_core.engines`` group: ``vllm``, ``sglang``), its options
(``weight_version``, ``flush_cache``, ``prepare``, ``slices``: each engine takes and validates its own),
``weight_version`` and ``stage``, ``_models.UpdateRequest``):

| route | does | collective |
|---|---|---|
| ``POST /v1/checkpoints/{name}/files`` | ``register_checkpoint(name, files=...)`` | no |
| ``DELETE /v1/checkpoints/{name}`` | ``unregister_checkpoint(name)`` | no |
| ``POST /v1/checkpoints/{name}/gather-metas`` | ``gather_metas(name)`` | yes: post to every rank |
| ``POST /v1/checkpoints/{name}/update`` | ``update(name, ...)`` (``_update.py``) | yes: post to every rank |
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
A collective route's refusals, a body that does not validate included, are agreed by every rank
before any collective (``_agree.py``): every rank answers the same error, once every rank was asked.

No ``/docs`` page: FastAPI's loads its scripts from a public CDN, which air-gapped clusters cannot
reach; ``/openapi.json`` is the schema.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any, Optional

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckpt_core._settings import MIN_TOKEN_CHARS
from ckpt_core.errors import CkptError, ConfigError
from ckpt_core.ops import metrics as _metrics

from ._agree import agree, refusal
from ._models import MAX_DETAILS, CommitRequest, Done, ErrorBody, RegisterRequest, Status, UpdateRequest
from ._policy import ServicePolicy
from ._state import Busy, ServiceState, clip, error_fields, status_of
from ._update import check_name, run_commit, run_update

UPDATE_ROUTE = "/v1/checkpoints/{name}/update"
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
    _install_errors(app, state, ps)
    if token is not None:
        _install_auth(app, token)
    _install_refusal_log(app, state)   # added last: outermost, so it sees the 401s of the token check too
    _checkpoint_routes(app, state, ps, policy if policy is not None else ServicePolicy())
    _state_routes(app, state, ps)
    return app


def _install_errors(app: FastAPI, state: ServiceState, ps) -> None:
    @app.exception_handler(CkptError)
    async def on_ckpt_error(request: Request, exc: CkptError):
        request.state.ckpt_logged = getattr(exc, "ckpt_logged", False)   # a long operation's log line said it
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
        message = f"invalid request: {where}{more}"
        if getattr(request.scope.get("route"), "path", None) == UPDATE_ROUTE:
            request.state.ckpt_logged = True   # the agreement's operation logs the refusal
            return await _agreed_refusal(state, ps, request.path_params.get("name", ""), message, details)
        return _error(422, "ValidationError", message, details=details)

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


async def _agreed_refusal(state: ServiceState, ps, name: str, message: str, details: list) -> JSONResponse:
    """An update whose body does not validate here: a collective route, so the other ranks, asked too,
    must not wait for this one. It takes part in the update's agreement with its refusal
    (``_agree.py``), and every rank answers the same error (422 ``ValidationError`` unless a lower rank
    refused otherwise); this rank's answer keeps its field errors."""
    try:
        await state.run("update", name, lambda: agree(ps, "update", name, ["ValidationError", message]))
    except Busy as exc:
        return _error(409, "Conflict", str(exc))
    except Exception as exc:   # the agreed refusal (always: this rank's own is in it)
        return JSONResponse({"error": dict(error_fields(exc), details=details)}, status_code=status_of(exc))
    raise AssertionError("an agreement carrying this rank's refusal returned")


def _install_refusal_log(app: FastAPI, state: ServiceState) -> None:
    """Every 4xx answer is counted (``ckpt_requests_refused_total``) and logged at WARNING with the
    method, route, status, error type and message: the token check (401), the policy (403), validation
    (422) refuse before any long operation runs, so nothing else would say so. A refusal a long
    operation already logged (its ``phase=... outcome=rejected`` line) is counted, not logged twice."""
    @app.middleware("http")
    async def refusals(request: Request, call_next):
        resp = await call_next(request)
        if not 400 <= resp.status_code < 500:
            return resp
        body = b"".join([chunk async for chunk in resp.body_iterator])   # our error bodies are bounded
        try:
            err = json.loads(body)["error"]
            kind, message = str(err.get("type", "HTTPError")), str(err.get("message", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            kind, message = "HTTPError", body[:200].decode(errors="replace")
        if state.metrics is not None:
            state.metrics.refused_request(resp.status_code, kind)
        if not getattr(request.state, "ckpt_logged", False):
            state.log.warning("refused %s %s status=%d error=%s: %s", request.method, request.url.path[:200],
                              resp.status_code, kind, clip(message.splitlines()[0] if message else "", 500))
        return Response(body, status_code=resp.status_code, headers=dict(resp.headers), media_type=resp.media_type)


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


def _checkpoint_routes(app: FastAPI, state: ServiceState, ps, policy: ServicePolicy) -> None:
    """The operations: register, unregister, gather, update, commit, load metas."""
    @app.post("/v1/checkpoints/{name}/files", response_model=Done)
    async def register_files(name: str, body: RegisterRequest):
        check_name(name)
        files = policy.check_files(body.files)   # before any file is opened: 403 outside --allow-dir

        def register():
            _check_host_memory(ps, files, body)   # before any memory is taken: 400 naming both sizes
            ps.register_checkpoint(name, files=files, use_shared_memory_pool=body.use_shared_memory_pool,
                                   use_inplace_pin_memory=body.use_inplace_pin_memory, base=body.base)
        await state.run("register", name, register, nbytes=_file_bytes(files))
        return Done(result=ps.last_register)

    @app.delete("/v1/checkpoints/{name}", response_model=Done)
    async def unregister(name: str, force: bool = Query(False)):
        await state.run("unregister", name, lambda: ps.unregister_checkpoint(name, force=force))
        return Done()

    @app.post("/v1/checkpoints/{name}/gather-metas", response_model=Done)
    async def gather_metas(name: str):
        def gather():   # a bad name is agreed like any refusal (_agree.py); ranks asked for another operation too
            agree(ps, "gather", name, refusal(check_name, name))
            ps.gather_metas(name)
        await state.run("gather", name, gather)
        return Done()

    @app.post(UPDATE_ROUTE, response_model=Done)
    async def update(name: str, body: Optional[UpdateRequest] = Body(default=None)):
        body = body if body is not None else UpdateRequest()   # every field has a default: no body is fine
        result = await state.run("update", name, lambda: run_update(ps, name, body, policy),
                                 nbytes=_registered_bytes(ps, name), weight_version=body.weight_version)
        return Done(result=result)

    @app.post("/v1/commit", response_model=Done)
    async def commit(body: CommitRequest):   # not collective: sent to one rank per engine, nothing to agree on
        result = await state.run("commit", body.version, lambda: run_commit(body, policy), weight_version=body.version)
        return Done(result=result)

    @app.post("/v1/metas", response_model=Done)
    async def load_metas(metas: dict[str, Any]):
        """Install a document from ``GET /v1/metas``; the PS validates it whole (400 when malformed)."""
        await state.run("load_metas", None, lambda: ps.load_metas(metas))
        return Done()


def _state_routes(app: FastAPI, state: ServiceState, ps) -> None:
    """What a rank holds and how it is: health, metas, status, metrics."""
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

    @app.get("/v1/status", response_model=Status)
    async def status():
        return Status(rank=ps.rank, world_size=ps.world_size, pid=os.getpid(), device_key=ps.device_uuid, wire=ps.wire,
                      checkpoints=ps.checkpoints(), gathered=ps.gathered(),
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
    if state.closed:
        return "this parameter server is closed"
    problem = ps.health_problem()
    if problem:
        return clip(problem)
    if state.liveness is not None:
        return state.liveness.problem()   # a peer rank (or the rendezvous store) went silent
    return None


def _registered_bytes(ps, name: str | None = None) -> int | None:
    """Host bytes of checkpoint ``name`` (None: all of them) registered on this rank."""
    return ps.registered_bytes(name)


def _file_bytes(files: list[str]) -> int | None:
    """Sizes of ``files`` on disk (the registration's start line); None when one cannot be read."""
    try:
        return sum(os.path.getsize(f) for f in files)
    except OSError:
        return None


def _check_host_memory(ps, files: list[str], body: RegisterRequest) -> None:
    """The host memory a registration of ``files`` will take, checked against what the host has. Files
    mapped in place (/dev/shm) take none; a free region of the shared pool large enough takes none."""
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
    if body.use_shared_memory_pool and ps.pool_free_bytes() >= needed:
        return
    check_host_memory(needed, host_memory_available(), what=f"registering {len(files)} file(s) on rank {ps.rank}")
