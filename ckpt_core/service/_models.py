"""Request and response bodies of the HTTP service (pydantic), and the error body.

Request models forbid unknown fields, so a misspelt field is a 422 naming it rather than a
silently ignored option. Field names of the update request are the reference's
(checkpoint-engine's ``UpdateRequest``), so existing controllers keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ckpt_core.engines.registry import DEFAULT_ENGINE, available_engines, get_engine

MAX_TIMEOUT_S = 7 * 24 * 3600.0   # one week: anything longer is a typo, not a plan
NAME_PATTERN = r"^[^/\x00-\x1f]{1,256}$"
MAX_FILES = 10_000    # files of one rank's share (the largest HF checkpoints have a few hundred shards)
MAX_PATH_CHARS = 4096   # PATH_MAX
MAX_DETAILS = 20      # validation errors listed in a 422


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Strict):
    """``POST /v1/checkpoints/{name}/files``: this rank's share of the checkpoint."""
    files: list[Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]] = Field(
        min_length=1, max_length=MAX_FILES, description="safetensors files of this rank's share")
    use_shared_memory_pool: bool = False
    use_inplace_pin_memory: bool = True
    base: Optional[str] = Field(default=None, min_length=1, max_length=256, pattern=NAME_PATTERN,
                                description="a checkpoint registered before (the version the engines hold): this "
                                            "version's delta against it is encoded too, for updates with delta "
                                            "(docs/deltas.md)")


def _engine_name(name: str) -> str:
    get_engine(name)   # a ConfigError (a ValueError: 422) naming the known engines
    return name


def _engine_schema(schema: dict) -> None:
    """The engines this service knows, the default first (names only: no engine is imported)."""
    schema["enum"] = [DEFAULT_ENGINE, *(e for e in available_engines() if e != DEFAULT_ENGINE)]


ENGINE_FIELD = dict(min_length=1, max_length=64, json_schema_extra=_engine_schema,
                    description="the kind of engine behind update_url (entry-point group ckpt_core.engines)")
# Request fields that are engine options: each engine's kind says which it takes (EngineKind.options)
# and validates them. An option left at its default asks for nothing. Other engines' options travel
# in `options` (an engine of the ckpt_core.engines group validates its own).
ENGINE_OPTIONS = ("weight_version", "flush_cache", "prepare", "slices", "deltas")
MAX_OPTIONS = 64


class UpdateRequest(_Strict):
    """``POST /v1/checkpoints/{name}/update``; every rank's service must receive one (collective).

    ``update_url`` (optional): where the handles of ``inference_group_ranks`` (all ranks when
    empty) are posted, over the Unix socket ``uds`` when given; ``engine`` names the engine behind
    it (``ckpt_core.engines``), which validates the options it takes. ``engine="vllm"`` (default,
    the reference's behaviour): ``update_url`` is the engine's ``/collective_rpc`` URL; options
    ``prepare``, ``slices``. ``engine="sglang"``: ``update_url`` is the SGLang server's base URL
    (``http://host:port``; a trailing ``/update_weights_from_ipc`` is accepted), which gets ``POST
    /update_weights_from_ipc``; options ``weight_version`` and ``flush_cache``; the service's PS
    must speak the stock wire (``ckpt-engine serve --wire stock``). An option the engine does not
    take is refused (422). ``timeout`` bounds the whole update, that request included.
    """
    ranks: list[int] = Field(default_factory=list, description="P2P target ranks; empty: broadcast to all")
    update_url: Optional[str] = Field(default=None, min_length=1, max_length=4096)
    inference_group_ranks: list[int] = Field(default_factory=list)
    timeout: float = Field(default=300.0, gt=0, le=MAX_TIMEOUT_S, description="seconds")
    uds: Optional[str] = Field(default=None, min_length=1, max_length=107)
    engine: str = Field(default=DEFAULT_ENGINE, **ENGINE_FIELD)
    weight_version: Optional[str] = Field(default=None, max_length=256,
                                          description="sglang only: the version SGLang reports after the update")
    flush_cache: bool = Field(default=True, description="sglang only: flush SGLang's KV cache after the update")
    stage: Optional[str] = Field(default=None, min_length=1, max_length=256,
                                 description="stage the update as this version (the engine keeps serving); "
                                             "POST /v1/commit switches to it. sglang: the server runs "
                                             "--custom-weight-loader ckpt_sglang.staging.load")
    stage_device_gib: float = Field(default=0.0, ge=0, le=1 << 20,
                                    description="with stage: device memory each worker may stage into, GiB "
                                                "(beyond it: pinned host memory)")
    prepare: bool = Field(default=False,
                          description="vllm, with stage: also turn the staged weights into the engine's kernel "
                                      "format between engine steps, so that the commit is one device copy "
                                      "(docs/vllm.md, prepared stages)")
    slices: bool = Field(default=False,
                         description="vllm: each engine worker receives only what its own loaders read, by a plan "
                                     "recorded from the engine at update_url (by the lowest rank whose request gives "
                                     "one; recorded once per model, layout and vLLM version, installed on its workers) "
                                     "and shared with every rank; broadcast, P2P and staged updates "
                                     "(docs/vllm.md, each worker only its slices)")
    delta: Union[bool, Literal["fallback"]] = Field(
        default=False, description="send only what changed since the version's base (registered with base; "
                                   "docs/deltas.md): true, or \"fallback\" (a refused delta becomes a full update); "
                                   "vllm: implies deltas")
    deltas: bool = Field(default=False,
                         description="vllm: the engine's workers keep this version as the base of later deltas "
                                     "(a host copy per worker; give it on the full update before the first delta; "
                                     "implied by delta)")
    options: dict[Annotated[str, Field(min_length=1, max_length=64)], Any] = Field(
        default_factory=dict, max_length=MAX_OPTIONS,
        description="options of the engine beyond the fields above (an engine of the ckpt_core.engines group "
                    "validates its own: one it does not take is a 422 naming it)")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return _engine_name(name)

    def engine_options(self) -> dict:
        """The engine options this request sets: the option fields given something other than their
        default, and ``options``."""
        given = {k: getattr(self, k) for k in ENGINE_OPTIONS
                 if k in self.model_fields_set and getattr(self, k) != type(self).model_fields[k].default}
        fields = sorted(set(self.options) & set(type(self).model_fields))
        if fields:
            raise ValueError(f"{', '.join(fields)} in options: give them as fields of the request")
        return {**given, **self.options}

    @model_validator(mode="after")
    def _options_of_the_engine(self) -> "UpdateRequest":
        if self.stage is not None and self.update_url is None:
            raise ValueError("stage needs an update_url (vllm: the engine's /collective_rpc; sglang: the server's URL)")
        if "stage_device_gib" in self.model_fields_set and self.stage is None:
            raise ValueError("stage_device_gib applies to a staged update (give stage)")
        get_engine(self.engine).check_options(self.engine_options(), staged=self.stage is not None)
        return self


class CommitRequest(_Strict):
    """``POST /v1/commit``: switch an engine to the version staged by an update with ``stage``.

    Pauses generation, loads the staged tensors on every worker of that engine through its own
    loader, resets what the old weights computed (vLLM's prefix cache; SGLang's cache with
    ``retract``), sets the engine's weight version, resumes. ``pause``: one of the engine's
    (``EngineKind.commit_pauses``, the first the default): vLLM ``keep`` (default: running requests
    freeze and continue on the new weights), ``wait``, ``abort``; SGLang ``retract`` (default: back
    to the queue, recomputed) or ``in_place``. Not collective: send it to one rank's service per engine.
    """
    update_url: str = Field(min_length=1, max_length=4096,
                            description="vllm: the engine's /collective_rpc URL; sglang: the server's URL")
    uds: Optional[str] = Field(default=None, min_length=1, max_length=107)
    engine: str = Field(default=DEFAULT_ENGINE, **ENGINE_FIELD)
    version: str = Field(min_length=1, max_length=256)
    pause: Optional[str] = Field(default=None, min_length=1, max_length=64,
                                 description="how the engine pauses for the commit (default: its first)")
    timeout: float = Field(default=300.0, gt=0, le=MAX_TIMEOUT_S, description="seconds")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return _engine_name(name)

    @model_validator(mode="after")
    def _pause_of_the_engine(self) -> "CommitRequest":
        pauses = get_engine(self.engine).commit_pauses
        if self.pause is None:
            self.pause = pauses[0]
        elif self.pause not in pauses:
            raise ValueError(f"pause {self.pause!r}: a {self.engine} commit pauses with one of {pauses}")
        return self


class ErrorDetail(BaseModel):
    type: str = Field(description="the ckpt_core.errors class (or ValidationError, Conflict, Unauthorized)")
    message: str
    rank: Optional[int] = None
    device_key: Optional[str] = None
    remote_traceback: Optional[str] = None
    details: Optional[list] = None
    # in /v1/status's last_error only:
    operation: Optional[str] = None
    checkpoint: Optional[str] = None
    status: Optional[int] = Field(default=None, description="the HTTP status the failing request got")
    at_unix: Optional[float] = Field(default=None, description="when it failed (unix seconds)")


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer of the service."""
    error: ErrorDetail


class Operation(BaseModel):
    """The long operation running now (at most one at a time)."""
    operation: str
    checkpoint: Optional[str] = None
    phase: str
    started_unix: float
    elapsed_s: float
    done: Optional[int] = None
    total: Optional[int] = None
    bytes: Optional[int] = Field(default=None, description="the checkpoint's bytes (update) or its files' (register)")
    weight_version: Optional[str] = None
    waiting_for: Optional[list[int]] = Field(
        default=None, description="a collective: ranks whose service has not been asked for it (yet)")


class Status(BaseModel):
    """``GET /v1/status``."""
    rank: int
    world_size: int
    pid: int
    device_key: str
    wire: str = Field(description="native, stock or stock-0.3 (ckpt-engine serve --wire)")
    checkpoints: list[str]
    gathered: list[str]
    running: Optional[Operation] = None
    updates: int
    failures: int
    last_update: Optional[dict] = None
    last_register: Optional[dict] = None
    last_error: Optional[ErrorDetail] = Field(default=None, description="cleared by the next success")
    last_success_unix: dict[str, float] = Field(default_factory=dict, description="operation -> when it last succeeded")
    registered_bytes: int = 0
    healthy: bool
    problem: Optional[str] = Field(default=None, description="why healthy is false")
    peers: Optional[dict[str, dict]] = Field(default=None, description="rank -> seconds since its last heartbeat "
                                             "and what it runs (worlds of several ranks)")


class Done(BaseModel):
    ok: bool = True
    result: Optional[dict] = None
