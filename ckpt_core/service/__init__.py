"""HTTP service of one parameter-server rank (extra ``server``: FastAPI, uvicorn, pydantic).

``create_app(ps)`` builds the FastAPI app; ``serve(ps, uds=PATH)`` runs it under uvicorn on a
Unix socket (mode 0600), or on TCP with a bearer token. ``ckpt-engine serve`` does both under
torchrun. Routes and error codes: :mod:`ckpt_core.service._app` and docs/operations.md.
"""

from ckpt_core.errors import ConfigError

try:
    from ._app import create_app, status_of
    from ._runner import bind_unix, serve
except ImportError as _exc:   # the optional dependencies are missing
    raise ConfigError(f"the HTTP service needs the 'server' extra (pip install 'ckpt-engine[server]'): {_exc}"
                      ) from _exc

__all__ = ["create_app", "serve", "bind_unix", "status_of"]
