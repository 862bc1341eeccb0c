"""What one service may touch, fixed by the operator at start: files it reads, engines it posts to.

Whoever can reach the service (its 0600 socket's owner, or a holder of the TCP bearer token)
names files and engine URLs in request bodies. The service acts on them only inside these
allow-lists, so that driving it grants no more than the operator meant (docs/operations.md,
"Security model"):

- **files** (``POST /v1/checkpoints/{name}/files``): absolute paths only, resolved (``..`` and
  every symlink) and then inside one of ``allow_dirs`` (``ckpt-engine serve --allow-dir DIR``,
  repeatable). Default: none, i.e. the service reads no files until the operator names a
  directory. A refused path is :class:`Forbidden` (403) naming the rule, checked before the file
  is opened, so the answer says nothing about the file (not even whether it exists).
- **engine endpoints** (``update_url``, ``uds`` of the update route): the URL's path must be a
  route of the named engine (``EngineKind.routes``: vLLM ``/collective_rpc``; SGLang the server's
  base URL, optionally with ``/update_weights_from_ipc``), below the path of an allowed base URL with the
  same scheme, host and port (``--engine-url``, repeatable). Default: http/https on a loopback
  host, any port. ``uds`` must be one of ``--engine-uds`` (resolved; default: none).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from ckpt_core.engines.registry import get_engine
from ckpt_core.errors import ConfigError

__all__ = ["Forbidden", "ServicePolicy"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


class Forbidden(ConfigError):
    """A request named a file or an engine endpoint outside what the operator allowed (HTTP 403)."""


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int
    path: str   # prefix, no trailing slash


def _origin(url: str, what: str) -> _Origin:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{what} {url[:200]!r} is not a URL: {exc}") from exc
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ConfigError(f"{what} must be http(s)://host[:port][/path], got {url[:200]!r}")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ConfigError(f"{what} must not carry credentials, a query or a fragment: {url[:200]!r}")
    return _Origin(parts.scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[parts.scheme],
                   parts.path.rstrip("/"))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _inside(path: str, directory: str) -> bool:
    return path == directory or os.path.commonpath([path, directory]) == directory


@dataclass(frozen=True)
class ServicePolicy:
    """The operator's allow-lists (``ServicePolicy.build`` validates them at start)."""
    allow_dirs: tuple[str, ...] = ()
    engine_urls: tuple[str, ...] = ()     # empty: any loopback host
    engine_uds: tuple[str, ...] = ()

    @classmethod
    def build(cls, allow_dirs=(), engine_urls=(), engine_uds=()) -> "ServicePolicy":
        dirs = []
        for d in allow_dirs:
            if not os.path.isabs(d) or not os.path.isdir(d):
                raise ConfigError(f"--allow-dir {d!r} must be an existing directory, named by absolute path")
            dirs.append(os.path.realpath(d))
        for u in engine_urls:
            _origin(u, "--engine-url")
        socks = []
        for s in engine_uds:
            if not os.path.isabs(s):
                raise ConfigError(f"--engine-uds {s!r} must be an absolute path")
            socks.append(os.path.realpath(s))
        return cls(tuple(dirs), tuple(engine_urls), tuple(socks))

    # -- files -----------------------------------------------------------------------------------
    def check_files(self, files: list[str]) -> list[str]:
        """The resolved paths of ``files``; :class:`Forbidden` for the first one outside ``allow_dirs``."""
        return [self._check_file(f) for f in files]

    def _check_file(self, path: str) -> str:
        rule = ("this service reads files only under the directories given with --allow-dir at start "
                f"({', '.join(self.allow_dirs) if self.allow_dirs else 'none given: it reads no files'})")
        if not os.path.isabs(path):
            raise Forbidden(f"file {path[:200]!r} is not an absolute path; {rule}")
        real = os.path.realpath(path)
        if not any(_inside(real, d) for d in self.allow_dirs):
            how = "" if real == os.path.normpath(path) else " once '..' and symlinks are resolved"
            raise Forbidden(f"file {path[:200]!r} is outside the allowed directories{how}; {rule}")
        return real

    # -- engine endpoints ------------------------------------------------------------------------
    def check_engine(self, update_url: str, uds: str | None, engine: str) -> str | None:
        """:class:`Forbidden` unless the update may post to ``update_url`` (over ``uds``); returns the
        resolved socket path to connect to (the one checked, not a name that may be re-pointed later).
        ``engine``: the engine's name; its routes are the paths ``update_url`` may have."""
        target = _origin(update_url, "update_url")
        routes = get_engine(engine).routes
        if uds is not None:
            real = os.path.realpath(uds) if os.path.isabs(uds) else None
            if real is None or real not in self.engine_uds:
                allowed = ", ".join(self.engine_uds) or "none given"
                raise Forbidden(f"uds {uds[:120]!r} is not an engine socket this service may post to "
                                f"(--engine-uds at start: {allowed})")
            if not any(target.path == r for r in routes):
                raise Forbidden(f"update_url {update_url[:200]!r}: over uds the path must be the {engine} route "
                                f"({' or '.join(repr(r or '/') for r in routes)})")
            return real
        if self.engine_urls:
            bases = [_origin(u, "--engine-url") for u in self.engine_urls]
            ok = any((b.scheme, b.host, b.port) == (target.scheme, target.host, target.port)
                     and target.path in {b.path + r for r in routes} for b in bases)
            rule = f"an engine given with --engine-url at start ({', '.join(self.engine_urls)})"
        else:
            ok = _is_loopback(target.host) and target.path in routes
            rule = "a loopback engine (no --engine-url given at start)"
        if not ok:
            raise Forbidden(f"update_url {update_url[:200]!r} is not the {engine} route "
                            f"({' or '.join(repr(r or '/') for r in routes)}) of {rule}")
        return None
