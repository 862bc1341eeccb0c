"""What one SGLang server offers, asked over HTTP and kept: weight-update sessions, our loaders,
and whether its model can be updated in place at all.

Sessions. SGLang (since #28001, e.g. 0.5.23) opens a weight-update session with
``POST /begin_weight_update`` (it restores weights that post-processing packed in place, so
checkpoint-format tensors load again) and closes it with ``POST /end_weight_update`` (it runs
the quantization post-processing). Its tensor and distributed routes refuse to load outside one;
its IPC route does not ask for one but then loads into packed weights. Older releases (0.5.17)
have neither route. :meth:`ServerFeatures.begin` is the probe: the first call opens a session or
learns from the 404 that the server has none, and later calls skip the route (no version strings).

Reloadability. Some of SGLang's quantized layers are not reload-safe: their post-processing
replaces the loaded weight by a new, transposed Parameter (without the ``weight_loader`` that
``load_weights`` uses), so loading a checkpoint into the live model again writes the wrong layout
and the next post-processing transposes it once more. Read in SGLang 0.5.17's (and 0.5.23's)
``layers/quantization``: ``fp8.py`` per tensor (no ``weight_block_size``) and online FP8,
``w8a8_fp8.py``, ``w8a8_int8.py``, ``modelopt_quant.py`` (FP8), and compressed-tensors' 8-bit
weights per tensor or channel (``schemes/compressed_tensors_w8a8_fp8.py``, ``..._w8a8_int8.py``,
``..._w8a16_fp8.py``). Neither release restores them in a session. :func:`reload_problem` names
those formats from the model's ``config.json`` and the server's ``--quantization``; the client
refuses such an update before anything is posted. Block FP8 (128x128, ``weight_scale_inv``) keeps
its Parameters and layout (without DeepGEMM) and is not refused; formats not named here are not
verified.
"""

from __future__ import annotations

import json
import logging
import os
import threading

from ckpt_core.engines.http import HttpTransport
from ckpt_core.errors import CkptError, ConfigError

__all__ = ["ServerFeatures", "reload_problem"]

log = logging.getLogger("ckpt_sglang.client")

_TRANSPOSING = ("w8a8_fp8", "w8a8_int8", "modelopt", "modelopt_fp8")


def reload_problem(quantization_config: dict | None, server_quantization: str | None = None) -> str | None:
    """Why SGLang cannot load a checkpoint of this format into its live model, or None.

    ``quantization_config``: the model's ``config.json`` block (None: unquantized);
    ``server_quantization``: the server's ``--quantization`` (online quantization of a float
    checkpoint, or an override). Pure: see the module docstring for where each rule comes from.
    """
    qc = quantization_config if isinstance(quantization_config, dict) else {}
    method = str(server_quantization or qc.get("quant_method") or "").lower()
    if not method:
        return None
    why = ("SGLang's post-processing replaces each such weight by a transposed copy (a new Parameter without "
           "its weight_loader), so a reload into the live model cannot equal a cold load; nothing was updated: "
           "restart the server on the new checkpoint")
    if method == "fp8" and not qc.get("weight_block_size"):
        kind = "FP8 per tensor" if qc.get("quant_method") == "fp8" else "online FP8 (--quantization fp8)"
        return f"the model is {kind} (quant_method fp8 without weight_block_size): {why}"
    if method in _TRANSPOSING:
        return f"the model is quantized with {method!r}: {why}"
    if method == "compressed-tensors":
        for group, spec in sorted((qc.get("config_groups") or {}).items()):
            weights = (spec or {}).get("weights") or {}
            if weights.get("num_bits") == 8 and weights.get("strategy") in ("tensor", "channel"):
                return (f"the model is compressed-tensors with 8-bit {weights.get('type')} weights per "
                        f"{weights.get('strategy')} ({group}): {why}")
    return None


class ServerFeatures:
    """One server's features, asked once each and kept (thread-safe); holds no connection of its own."""

    def __init__(self, http: HttpTransport):
        self._http = http
        self._lock = threading.Lock()
        self._info: dict | None = None
        self.sessions: bool | None = None   # None: not asked yet
        self._reload: tuple[str, str | None] | None = None   # (model_path, problem) last checked
        self._first_weights = False   # an IPC update of ours succeeded here

    def info(self) -> dict:
        """``GET /server_info`` (the server's arguments), read once."""
        if self._info is None:
            resp = self._http.request("GET", "/server_info", timeout=30.0)
            self._http.raise_for_status(resp)
            self._info = resp.json()
        return self._info

    def require_loader(self, loader: str, what: str) -> int:
        """The server's TP size, once it is known to run ``loader`` (``--custom-weight-loader``).
        An unknown ``load_format`` would end SGLang's scheduler: never send one."""
        info = self.info()
        if loader not in (info.get("custom_weight_loader") or []):
            raise ConfigError(f"{self._http.where} was not started with --custom-weight-loader {loader} (it has "
                              f"{info.get('custom_weight_loader')}): {what} need it")
        if int(info.get("dp_size") or 1) != 1:
            raise ConfigError(f"{self._http.where} has dp_size {info.get('dp_size')}: SGLang's weight routes need 1")
        return int(info.get("tp_size") or 1)

    def has_loader(self, loader: str) -> bool:
        """Whether the server runs ``loader`` and our loader's ops can reach it (dp_size 1)."""
        info = self.info()
        return loader in (info.get("custom_weight_loader") or []) and int(info.get("dp_size") or 1) == 1

    def awaiting_first_weights(self) -> bool:
        """Whether the server may still wait for its first weights: started with
        ``--checkpoint-engine-wait-weights-before-ready``, no IPC update of ours succeeded on it yet
        (only a successful ``/update_weights_from_ipc`` sets SGLang's ``initial_weights_loaded``), and
        ``GET /health`` is not 200 (such a server stays "starting", 503, until its first weights came).
        Once known loaded, kept."""
        if self._first_weights or not self.info().get("checkpoint_engine_wait_weights_before_ready"):
            return False
        try:
            healthy = self._http.request("GET", "/health", timeout=60.0).status_code == 200
        except CkptError as exc:
            log.debug("%s: GET /health failed (%s): taken as still waiting for its first weights",
                      self._http.where, exc)
            healthy = False
        if healthy:
            self.first_weights_loaded()
        return not healthy

    def first_weights_loaded(self) -> None:
        """An IPC update succeeded: the server has its first weights."""
        self._first_weights = True

    # -- weight-update sessions ----------------------------------------------------------
    def begin(self, selector: str, timeout: float = 60.0) -> bool:
        """Open SGLang's weight-update session; False where the server has none (no such route)."""
        if self.sessions is False:
            return False
        resp = self._http.request("POST", "/begin_weight_update", json={"selector": selector}, timeout=timeout)
        if resp.status_code == 404:
            with self._lock:
                said, self.sessions = self.sessions, False
            if said is None:
                log.info("%s has no weight-update sessions (no /begin_weight_update): updates load without one",
                         self._http.where)
            return False
        self._http.raise_for_status(resp)
        self.sessions = True
        return True

    def end(self, timeout: float = 300.0) -> None:
        """Close the session :meth:`begin` opened (SGLang post-processes the loaded weights here)."""
        self._http.raise_for_status(self._http.request("POST", "/end_weight_update", json={}, timeout=timeout))

    # -- can this model be updated in place -------------------------------------------------
    def reload_problem(self) -> str | None:
        """:func:`reload_problem` of the served model (its ``config.json``, read where ``/model_info``
        says the server loaded it; same host, as the IPC buffers are). None when nothing can be
        told: the server does not answer (the update's own post then fails as it would), or its
        model path is no local directory (a hub name)."""
        try:
            resp = self._http.request("GET", "/model_info", timeout=30.0)
            self._http.raise_for_status(resp)
            path = str(resp.json().get("model_path") or "")
            if self._reload is not None and self._reload[0] == path:
                return self._reload[1]
            quantization = self.info().get("quantization")
        except (CkptError, ValueError) as exc:
            log.debug("%s: cannot tell whether its model reloads (%s); not refused here", self._http.where, exc)
            return None
        config = os.path.join(path, "config.json")
        try:
            with open(config) as f:
                qc = json.load(f).get("quantization_config")
        except (OSError, ValueError, AttributeError) as exc:
            log.debug("%s: cannot read %s (%s); not refused here", self._http.where, config, exc)
            return None
        problem = reload_problem(qc, quantization)
        self._reload = (path, problem)
        return problem

    def check_reloadable(self) -> None:
        problem = self.reload_problem()
        if problem:
            raise ConfigError(f"{self._http.where} cannot be updated in place: {problem}")
