"""Serving the app: a Unix socket (mode 0600) by default, TCP only with a bearer token.

The Unix socket is bound and chmod-ed to 0600 *before* ``listen()``, so there is no moment at
which another user could connect; uvicorn then serves the already-listening socket.
"""

from __future__ import annotations

import os
import socket
import stat

from ckpt_core.errors import ConfigError
from ckpt_core.ops.log import rank_logger

UDS_MODE = 0o600
DIR_MODE = 0o700
MAX_UDS_PATH = 107   # sun_path is 108 bytes with the NUL
# How long an idle client connection stays open. uvicorn's default, 5 s, is httpx's default keep-alive
# expiry too: a client that posts again about 5 s after its last answer (an RL loop's next update after a
# generation step) could send on a connection the service was closing and get "server disconnected" on one
# rank, while the other ranks waited in the update's collective until its timeout. A service that keeps idle
# connections longer than its clients do is never the one to close a connection a request is on its way to.
KEEP_ALIVE_S = 75


def default_socket_dir() -> str:
    """A directory only this user can enter, for the default socket: ``$XDG_RUNTIME_DIR/ckpt-engine`` (the
    per-user runtime directory, itself 0700), else ``/tmp/ckpt-engine-UID``; created 0700. One that exists
    but belongs to another user, is a symlink, or lets others in is refused (in world-writable /tmp,
    anyone could have made it first, to see or replace the socket)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = os.path.join(runtime, "ckpt-engine") if runtime and os.path.isdir(runtime) else \
        os.path.join("/tmp", f"ckpt-engine-{os.getuid()}")
    try:
        os.mkdir(base, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create the socket directory {base!r}: {exc}; give --uds") from exc
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(f"the socket directory {base!r} is not a directory of this user with mode 0700 "
                          f"(mode {oct(stat.S_IMODE(st.st_mode))}, owner uid {st.st_uid}); remove it or give --uds")
    return base


def bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` with mode 0600.

    A stale socket file (nobody listening) is replaced; a live one, or any other kind of file,
    is a ``ConfigError`` (we never delete what is not ours to delete).
    """
    if len(os.fsencode(path)) > MAX_UDS_PATH:
        raise ConfigError(f"unix socket path is longer than {MAX_UDS_PATH} bytes: {path!r}")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"{path!r} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except OSError:
            os.unlink(path)          # stale: its server is gone
        else:
            raise ConfigError(f"another server already listens on {path!r}")
        finally:
            probe.close()
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"the directory of the unix socket does not exist: {parent!r}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, UDS_MODE)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on unix socket {path!r}: {exc}") from exc
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


def _server_class():
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, which would kill the process
        before the ParameterServer is closed and the socket file removed: we stop cleanly instead."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()
    return _Server


def _check_where(uds: str | None, host: str | None, port: int | None, token: str | None, check_token) -> None:
    if (uds is None) == (host is None and port is None):
        raise ConfigError("serve on either a unix socket (uds=...) or TCP (host=..., port=...), not both or neither")
    if uds is None and not token:
        raise ConfigError("TCP serving requires a bearer token (--token-file or CKPT_SERVICE_TOKEN)")
    if token is not None:
        check_token(token)


def _log_serving(log, where: str, token: str | None, policy) -> None:
    log.info("phase=serve listening on %s (%s)", where, "bearer token required" if token else "unix socket, mode 0600")
    if policy is not None:
        log.info("phase=serve reads files under %s; posts to engines %s%s", list(policy.allow_dirs) or "no directory",
                 list(policy.engine_urls) or "on loopback hosts",
                 f" and over the sockets {list(policy.engine_uds)}" if policy.engine_uds else "")


def serve(ps, *, uds: str | None = None, host: str | None = None, port: int | None = None,
          token: str | None = None, log_level: str = "warning", policy=None, metrics_port: int | None = None) -> bool:
    """Serve ``ps`` until SIGINT/SIGTERM; then close the socket (and remove the socket file).

    Returns False when a long operation was still running 10 s after the stop (the caller
    should then exit without closing ``ps``: its collective may never return).
    ``policy``: a ``ServicePolicy`` (the files and engine endpoints requests may name; default:
    no files, loopback engines).

    Exactly one of ``uds`` or ``host``/``port``. TCP requires ``token`` (at least 16 characters): the
    service moves model weights into engines and must not be driven by anyone who can reach a port.
    ``metrics_port``: also serve ``GET /metrics`` alone on 127.0.0.1 (Prometheus cannot scrape a Unix
    socket); 0 picks a free port (logged). In a world of several ranks a heartbeat thread watches the
    peers (``_liveness.py``; CKPT_HEARTBEAT_S, CKPT_PEER_TIMEOUT_S).

    Example (one process per rank, under torchrun)::

        with ParameterServer() as ps:
            serve(ps, uds=f"/run/ckpt/ps-{ps.rank}.sock")
    """
    import uvicorn

    from ._app import check_token, create_app
    _Server = _server_class()

    _check_where(uds, host, port, token, check_token)
    log = rank_logger(f"service rank {ps.rank}/{ps.world_size}")
    app = create_app(ps, token=token, policy=policy)
    state = app.state.service
    try:
        extras = _start_extras(ps, state, metrics_port, log)
        sock = bind_unix(uds) if uds is not None else bind_tcp(host or "127.0.0.1", int(port or 0))
    except BaseException:
        state.close(0)
        raise
    where = uds if uds is not None else "%s:%d" % sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = _Server(config)
    _log_serving(log, where, token, policy)
    idle = False
    try:
        server.run(sockets=[sock])
    finally:
        idle = state.close()   # waits (bounded) for a long operation still running
        for server in extras:
            server.shutdown()
            server.server_close()
        sock.close()
        if uds is not None and os.path.lexists(uds):
            os.unlink(uds)
        log.info("phase=serve stopped")
    return idle


def _start_extras(ps, state, metrics_port: int | None, log) -> list:
    """The heartbeat thread (several ranks) and the metrics port (asked for); the servers to stop."""
    from ckpt_core._settings import liveness
    beat_s, timeout_s = liveness()
    settings = getattr(ps, "settings", None)
    if ps.world_size > 1 and settings is not None:
        from ._liveness import Liveness
        state.liveness = Liveness(state, ps.rank, ps.world_size, settings.master_addr, settings.master_port,
                                  beat_s=beat_s, timeout_s=timeout_s).start()
    if metrics_port is None:
        return []
    if state.metrics is None:
        raise ConfigError("--metrics-port needs prometheus-client: pip install 'ckpt-engine[server]'")
    server = state.metrics.serve_on(metrics_port)
    log.info("phase=serve metrics on http://127.0.0.1:%d/metrics", server.server_address[1])
    return [server]
