"""Server settings: `GREENLANE_*` environment variables, overridden by CLI flags.

`Settings` holds the server's own options plus one field per `runtime.config.EngineConfig`
field (generated from the dataclass, so a new engine option is settable here without an edit);
`to_engine_config()` builds the frozen `EngineConfig` the engine takes, choosing the JCT
model's calibration file (explicit `--jct-calibration`, else the cached
`calibration-<device>--<model>.json` with a `jct` section in `--calibration-dir`, else an old
`jct-<device>--<model>.json` there, else none: the documented fallback) and logging the choice
(runtime/calibrate.py). The partition cost model's section is chosen by the engine
(runtime/partition/calibrate.py), in `--partition-calibration-dir`, which defaults to
`--calibration-dir`: by default both sections live in the same file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, create_model, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.calibrate import model_key, resolve_calibration
from runtime.config import EngineConfig
from runtime.core.process import PROFILE_DIR_ENV
from runtime.model.convert import CACHE_DIR_ENV

log = logging.getLogger("greenlane.app")

ENV_PREFIX = "GREENLANE_"
MAX_API_SERVERS = 64  # --api-server-count's cap


class ServerSettings(BaseSettings):
    """The HTTP server's own options (not passed to the engine)."""

    # hide_input_in_errors: a bad option must not print the API key or admin token.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", hide_input_in_errors=True
    )

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    served_model_name: str | None = Field(
        None,
        description="model name clients send and /v1/models lists (default: derived from --model)",
    )
    api_key: str | None = Field(
        None, description="when set, /v1/* requires 'Authorization: Bearer <key>'"
    )
    api_key_file: str | None = Field(
        None,
        description="read the API key from this file (first line) instead of --api-key, which "
        "shows in `ps`",
    )
    admin_token: str | None = Field(
        None,
        description="token for the admin API and the read endpoints (/admin/api/*, /metrics, "
        "/docs); unset: admin changes only from loopback clients",
    )
    admin_token_file: str | None = Field(
        None, description="read the admin token from this file (first line)"
    )
    allowed_hosts: str | None = Field(
        None,
        description="comma-separated extra Host names accepted when the server listens on a "
        "loopback address (DNS-rebinding guard; localhost names and IP addresses are always "
        "accepted; '*' accepts any)",
    )
    max_body_bytes: int | None = Field(
        None,
        ge=1,
        description="largest request body in bytes; larger ones get 413 (default: 64 bytes per "
        "token of max_model_len, at least 4 MiB)",
    )
    admin_max_event_streams: int = Field(
        8, ge=1, description="open /admin/api/events streams allowed at once; more get 429"
    )
    max_queue: int = Field(
        256,
        ge=0,
        description="requests allowed to wait beyond max_num_seqs running ones; more get 429",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After value sent with 429")
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="auto: a request that leaves temperature, top_p, top_k, min_p or "
        "repetition_penalty out gets the model's generation_config.json value (as vLLM); "
        "none: the server's (temperature 1, top_p 1, no top_k / min_p / repetition penalty)",
    )
    # (the names are app/tool_calls.py's TOOL_CALL_PARSERS, and "none")
    tool_call_parser: Literal["none", "hermes", "llama3_json", "mistral", "pythonic"] = Field(
        "none",
        description="how tool_choice auto (OpenAI's default with tools) reads tool calls back "
        "from the model's own format: hermes = <tool_call>{json}</tool_call> (Qwen2.5, Qwen3, "
        'Hermes); llama3_json = the answer is {"name": ..., "parameters": ...} '
        "(Llama 3.1 / 3.2); mistral = [TOOL_CALLS] then a JSON array of calls, or "
        "name[ARGS]{json} per call (Mistral-Instruct v0.3, Mistral-Nemo, Mistral-Small); "
        'pythonic = the answer is a Python list of calls, [f(a=1), g(b="x")] (Llama 3.2, '
        "Llama 4); none = auto is a 400 (named and required tool calls need no parser)",
    )
    # No limit by default, as vLLM: a long generation is not an error, a client that leaves
    # aborts its request anyway, and a 504 invites the OpenAI SDK to run the whole request again.
    request_timeout_s: float | None = Field(
        None,
        gt=0,
        description="abort a non-streaming request (504) after this many seconds (a stream "
        "runs until it ends or its client leaves); unset = no limit",
    )
    shutdown_grace_s: float = Field(
        10.0,
        ge=0,
        description="on SIGTERM/SIGINT, let running requests finish this long, then abort",
    )
    keep_alive_s: int = Field(
        75,
        ge=1,
        description="keep an idle HTTP connection open this long (s): longer than clients keep "
        "one in their pool (httpx and the OpenAI SDK: 5 s), so a client never reuses a "
        "connection the server is closing",
    )
    log_level: str = Field("info", description="debug | info | warning | error")
    api_server_count: int = Field(
        1,
        ge=1,
        le=MAX_API_SERVERS,
        description="HTTP front-end processes (tokenizing, detokenizing, SSE), sharing the port "
        "and one engine core process",
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="text | json (one JSON object per log line)"
    )
    stats_log_interval_s: float = Field(
        10.0,
        ge=0,
        description="log one engine line (throughput, running, waiting, KV usage, prefix hit "
        "rate) this often; 0 turns it off",
    )
    calibrate: bool = Field(
        False,
        description="profile prefill times on this device at start-up (before serving), save "
        "them as the jct section of the calibration file in calibration_dir and use it",
    )
    calibration_dir: str | None = Field(
        None,
        description="folder of calibration files, one per device and model "
        "(calibration-<device>--<model>.json: the JCT model's and the partition cost model's "
        "sections; default $XDG_CACHE_HOME/greenlane/calibration or "
        "~/.cache/greenlane/calibration)",
    )

    @model_validator(mode="after")
    def _read_secret_files(self) -> ServerSettings:
        """--api-key-file / --admin-token-file: the secret's first line (surrounding
        whitespace dropped). Giving a secret both ways is a mistake, not a precedence rule."""
        for name in ("api_key", "admin_token"):
            path = getattr(self, f"{name}_file")
            if path is None:
                continue
            flag = name.replace("_", "-")
            if getattr(self, name):
                raise ValueError(f"give --{flag} or --{flag}-file, not both")
            try:
                lines = Path(path).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--{flag}-file {path!r} cannot be read: {exc}") from None
            secret = lines[0].strip() if lines else ""
            if not secret:
                raise ValueError(f"--{flag}-file {path!r} is empty")
            setattr(self, name, secret)
        return self


def _engine_field_definitions() -> dict[str, Any]:
    """(type, default) pairs for every EngineConfig field, for `create_model`."""
    hints = typing.get_type_hints(EngineConfig)
    defs: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        defs[f.name] = (hints[f.name], Field(default, description=f"engine: {f.name}"))
    return defs


# `model` is both the engine's model spec and the basis of the served name.
_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))
_overlap = set(_ENGINE_FIELDS) & set(ServerSettings.model_fields)
assert not _overlap, f"server and engine option names collide: {_overlap}"

_SettingsBase = create_model(  # type: ignore[call-overload]
    "_SettingsBase", __base__=ServerSettings, **_engine_field_definitions()
)


# Engine options whose unset value (None) means "the engine sizes it": `auto` (and `none`)
# say so on the command line and in the environment.
AUTO_WHEN_UNSET = frozenset({"prefill_chunk_tokens", "prefill_warm_up_tokens", "num_kv_blocks"})
# Words that leave an optional engine option unset (None), on the command line and in the
# environment; `auto` too for AUTO_WHEN_UNSET's options. The command line also takes an empty
# value (`--x ""`).
UNSET_WORDS = ("none", "null")


class Settings(_SettingsBase):  # type: ignore[valid-type,misc]
    """All options. Precedence: constructor kwargs (the CLI) > GREENLANE_* env > defaults."""

    @model_validator(mode="before")
    @classmethod
    def _auto_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in AUTO_WHEN_UNSET & data.keys():
                value = data[name]
                if isinstance(value, str) and value.strip().lower() in (*UNSET_WORDS, "auto"):
                    data = {**data, name: None}
        return data

    def to_engine_config(self, resolve_calibration: bool = True) -> EngineConfig:
        """The engine's config. With `resolve_calibration`, `jct_calibration` is the file the
        engine should load (explicit, else cached for this device+model, else None = the
        fallback default), and the choice is logged; without it, the option as given."""
        values = {name: getattr(self, name) for name in _ENGINE_FIELDS}
        # The partition cost model's calibration files live beside the JCT ones unless a
        # folder of their own is given; the engine picks the file (it knows the GPU's SMs).
        values["partition_calibration_dir"] = self.partition_calibration_dir or self.calibration_dir
        if resolve_calibration:
            path, why = resolve_calibration_file(self)
            values["jct_calibration"] = path
            log.info("%s", why)
        return EngineConfig(**values)

    @property
    def calibration_model_key(self) -> str:
        """The model name calibration files are keyed by (from --model, not the served name)."""
        return model_key(self.model)

    @property
    def model_name(self) -> str:
        """The name clients use for this model (`model` in requests, `/v1/models`)."""
        if self.served_model_name:
            return self.served_model_name
        spec: str = self.model
        if spec == "default":
            return "SmolLM2-135M-Instruct"
        if os.sep in spec or os.path.isdir(spec):
            return os.path.basename(os.path.normpath(spec))
        return spec

    def accepts_model(self, name: str | None) -> bool:
        """Requests may omit the model, or name it by its served name or its --model spec."""
        return name is None or name == "" or name in (self.model_name, self.model)


def engine_field_names() -> tuple[str, ...]:
    return _ENGINE_FIELDS


# GREENLANE_* variables the server reads that are not options.
ENV_NOT_OPTIONS = frozenset({CACHE_DIR_ENV, PROFILE_DIR_ENV})


def unknown_env_options(environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """The GREENLANE_* variables that name no option (a typo, or an option since removed):
    the settings ignore them (extra="ignore"), so the command line says so."""
    environ = os.environ if environ is None else environ
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields} | ENV_NOT_OPTIONS
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)


def resolve_calibration_file(settings: Settings) -> tuple[str | None, str]:
    """(path or None, a log line saying which JCT calibration is used and why)."""
    return resolve_calibration(
        settings.jct_calibration, settings.calibration_dir, settings.device, settings.model
    )
