"""The managed PS ranks an engine server starts itself (``CKPT_ENGINE_SERVE``), on ports of ``free_port()``'s.

A managed PS rank 0 binds its store on ``CKPT_ENGINE_SERVE_MASTER`` 20-35 s after the test picked that
port (the engine imports and builds its workers first); a TCP rank binds its service's port later still.
Another process of the two-half suite can be handed either in between: the PS exits, the engine serves
on without it. ``ManagedPs`` picks those ports afresh for each launch of the server and tells from the
PS ranks' logs, the one place that says why, whether they serve, lost a picked port before anything
ran (the only outcome that launches the server again), or failed otherwise.

    managed = ManagedPs(f"uds:{where}/ps-{{rank}}.sock", ranks=2)
    server = VllmServer(..., managed=managed)   # its env: managed.pick() at each launch
"""

from __future__ import annotations

import re

from ckpt_core.engines.managed import log_path_of
from support import ports

SERVING = "phase=serve listening on"   # ckpt-engine serve's line once its socket listens
FATAL = "ckpt-engine serve: "          # the CLI's one line per fatal error, as the process ends


class ManagedPs:
    """The managed PS ranks of one server: ``spec`` is ``CKPT_ENGINE_SERVE``, ``{port}`` standing for a
    TCP service's port (picked with the store's: rank i serves on it + i); ``ranks``: the engine's
    world size (one PS rank per worker). Every rank must log (a Unix socket's default ``PATH.log``, or
    ``log=PATH``): without logs nothing can be told, and ``state()`` stays "starting"."""

    def __init__(self, spec: str, ranks: int = 1):
        self.template, self.ranks = spec, ranks
        self.store_port: int | None = None
        self.port: int | None = None   # the TCP service's (rank 0's), None on Unix sockets
        self._starts: list[int] = []   # where each rank's log stood at this launch (the PS appends to it)

    def pick(self) -> dict[str, str]:
        """Fresh ports for the next launch; the server's managed-mode environment."""
        self.store_port = ports.free_port()
        self.port = ports.free_port() if "{port}" in self.template else None
        self._starts = [_size(path) for path in self.logs()]
        return {"CKPT_ENGINE_SERVE": self.spec, "CKPT_ENGINE_SERVE_MASTER": f"127.0.0.1:{self.store_port}"}

    @property
    def spec(self) -> str:
        return self.template.replace("{port}", str(self.port))

    def services(self) -> list[str]:
        """The ranks' service URLs of a TCP spec (``http://HOST:PORT+i``)."""
        host = self.spec.split(",")[0].split(":")[1]
        return [f"http://{host}:{self.port + r}" for r in range(self.ranks)]

    def logs(self) -> list[str | None]:
        return [log_path_of(self.spec, r, r) for r in range(self.ranks)]   # local rank = rank: one host

    def _texts(self) -> list[str]:
        """What each rank logged in this launch."""
        texts = []
        for path, start in zip(self.logs(), self._starts or [0] * self.ranks):
            try:
                with open(path or "", "rb") as f:
                    f.seek(start)
                    texts.append(f.read().decode(errors="replace"))
            except OSError:
                texts.append("")
        return texts

    def lost_port(self, texts: list[str] | None = None) -> bool:
        """Whether a rank ended because another process held a port picked for it, before it served
        anything: rank 0 its store (``ports.store_lost_port``), or a TCP rank its service's port
        (``cannot listen on HOST:PORT+i: [Errno 98] Address already in use``) -- each the rank's fatal
        line, and that rank never listened."""
        texts = self._texts() if texts is None else texts
        for r, text in enumerate(texts):
            if SERVING in text or FATAL not in text:
                continue
            fatal = text[text.rfind(FATAL):]   # the error's message may span lines (torch's)
            if r == 0 and ports.store_lost_port(fatal, self.store_port):
                return True
            if self.port is not None and re.search(rf"ConfigError: cannot listen on \S+:{self.port + r}: "
                                                   r".*address already in use", fatal, re.I):
                return True
        return False

    def state(self) -> str:
        """"serving" (every rank listens), "lost" (``lost_port``), "failed" (a rank ended otherwise),
        else "starting"."""
        texts = self._texts()
        if self.lost_port(texts):
            return "lost"
        if any(FATAL in t for t in texts):
            return "failed"
        return "serving" if all(SERVING in t for t in texts) else "starting"

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- managed PS rank {r} log {path} ---\n{text[-chars:] or '(empty)'}"
                         for r, (path, text) in enumerate(zip(self.logs(), self._texts())))


def _size(path: str | None) -> int:
    try:
        with open(path or "", "rb") as f:
            return f.seek(0, 2)
    except OSError:
        return 0
