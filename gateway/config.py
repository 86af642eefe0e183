"""Gateway configuration: one frozen dataclass, built once from the command line.

Each field that a flag sets declares that flag too (`_flag`): its name, help and argparse details, and
whether `pdserve up` takes it and hands it on. `GATEWAY_FLAGS` gathers them as rows of the flag table
(pdserve/launch/flags.py), from which `pdserve gateway`'s parser, `pdserve up`'s and the gateway's
command line under `pdserve up` are built. The flags the gateway shares with the workers (--model-path,
--log-level, --grammar-backend, --grammar-compile-timeout, --cluster-secret-file) are rows of
pdserve/launch/worker_flags.py; their fields here have the same names.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal, TypeVar

from pdserve import env
from pdserve.config import GRAMMAR_COMPILE_TIMEOUT_S
from pdserve.gateway.text.function_call import PARSER_NAMES
from pdserve.gateway.text.reasoning import REASONING_PARSERS
from pdserve.launch.flag import GATEWAY, TO_GATEWAY, UP, Flag
from pdserve.launch.flags import add_flags, flags_of

# A config field with this metadata is never shown: not in its repr, not in `public_config`.
SECRET = types.MappingProxyType({"secret": True})
_GW = frozenset({GATEWAY})
_GW_UP = frozenset({GATEWAY, UP})
T = TypeVar("T")

# The routing policies a role may follow (gateway/cluster/workers.py RoutingPolicy), and below the elastic
# controller's settings: declared here, beside their flags, so that the configuration imports nothing from the
# rooms that read it (tests/gateway/test_rooms.py).
Policy = Literal["cache_aware", "round_robin", "least_load"]
POLICIES: tuple[Policy, ...] = ("cache_aware", "round_robin", "least_load")


# The elastic controller's targets and thresholds (gateway/autopilot/elastic.py), set by --elastic-*.
@dataclass(frozen=True)
class ElasticConfig:
    ttft_slo: float = 2.0  # seconds
    tpot_slo: float = 0.1  # seconds per output token after the first
    interval_s: float = 2.0
    window_s: float = 30.0
    cooldown_s: float = 30.0
    confirm: int = 3  # checks in a row that agree
    min_per_role: int = 1
    min_samples: int = 4  # finished requests in the window before their misses count
    queue_high: float = 4.0  # prefill requests waiting per worker that count as full pressure
    fill_high: float = 0.75  # decode batch fill that counts as full pressure
    pressure_high: float = 0.5
    margin: float = 0.25

    def __post_init__(self) -> None:
        if (
            min(self.ttft_slo, self.tpot_slo, self.interval_s, self.window_s, self.queue_high, self.fill_high)
            <= 0
        ):
            raise ValueError("--elastic targets, interval, window and thresholds must be > 0")
        if self.cooldown_s < 0 or self.confirm < 1 or self.min_per_role < 1 or self.min_samples < 0:
            raise ValueError("--elastic-cooldown must be >= 0, --elastic-confirm and the role minimum >= 1")


def _flag(
    value: T, name: str, help: str | None = None, *, up: bool = False, secret: bool = False, **kw: Any
) -> T:
    """A field set by the flag `name`; `value` is the default of both unless `kw` gives the flag its own
    (a function, called when a parser is built). up: `pdserve up` takes it too and hands it to its
    gateway, a secret one by environment only (up.key_env): a command line is visible in the process list."""
    row = Flag(
        name,
        _GW_UP if up else _GW,
        help,
        passed_to=TO_GATEWAY if up and not secret else frozenset(),
        **{"default": value, **kw},
    )
    meta = {"flag": row, **SECRET} if secret else {"flag": row}
    return field(default=value, repr=not secret, metadata=meta)


@dataclass(frozen=True)
class GatewayConfig:
    host: str = _flag(
        "0.0.0.0",
        "--host",
        "the gateway's HTTP bind address (default 0.0.0.0; `pdserve up`'s: 127.0.0.1)",
        up=True,
        role_default={UP: "127.0.0.1"},
    )
    port: int = _flag(30000, "--port", type=int)
    # Where the control-plane ROUTER socket binds; workers connect DEALER sockets here.
    control_host: str = _flag(
        "127.0.0.1",
        "--control-host",
        "bind address of the worker (control) socket; 0.0.0.0 when workers run on other hosts",
    )
    control_port: int = _flag(30001, "--control-port", type=int)
    # None: the bundled default model (only its tokenizer is loaded here).
    model_path: str | None = None
    served_model_name: str | None = _flag(
        None,
        "--served-model-name",
        "the name clients send as `model` (default: the model's own: the bundled model's Hugging Face "
        "id, else --model-path)",
        up=True,
    )
    # Tool-call format (gateway/text/function_call/): None means hermes when a request has tools.
    tool_call_parser: str | None = _flag(
        None,
        "--tool-call-parser",
        "how tool calls are found in the model's output (SGLang's names; default: hermes)",
        up=True,
        choices=tuple(PARSER_NAMES),
    )
    # Reasoning format (gateway/text/reasoning.py): None leaves thinking text in content.
    reasoning_parser: str | None = _flag(
        None,
        "--reasoning-parser",
        "split <think>...</think> text into reasoning_content (default: off)",
        up=True,
        choices=tuple(sorted(REASONING_PARSERS)),
    )
    # A chat completion's `metadata` as the seed has it (the per-token `weight_versions` inside), or,
    # strict, a map of strings as OpenAI types it (`weight_versions` beside it, at the top level).
    strict_openai_metadata: bool = _flag(
        False,
        "--strict-openai-metadata",
        "a completion's `metadata` holds strings only, as OpenAI types it (the per-token "
        "`weight_versions` move beside it): for clients that validate it, e.g. the openai Python client",
        up=True,
        switch=True,
    )
    heartbeat_interval_s: float = _flag(1.0, "--heartbeat-interval", type=float)
    heartbeat_timeout_s: float = _flag(5.0, "--heartbeat-timeout", type=float)
    # Past it, refused at once rather than queued: a 503 says "come back later" while the queue is full.
    max_pending_generations: int = _flag(
        512,
        "--max-pending-generations",
        "generations (prompts x n, over all requests) in flight; more is a 503 with Retry-After",
        up=True,
        type=int,
        aliases=("--max-pending-requests",),
    )
    max_requests_per_client: int = _flag(
        256,
        "--max-requests-per-client",
        "generation requests in flight per client (its API key, else its IP address); more is a 429 "
        "(0: no limit)",
        up=True,
        type=int,
    )
    # 4 MiB: nginx's default is 1 MiB; a body's JSON is parsed whole, and a 4 MiB one of the costliest
    # shape (a million empty lists) takes about 0.1 s to parse.
    max_request_bytes: int = _flag(
        4 << 20, "--max-request-bytes", "a larger body is a 413 (default 4 MiB)", up=True, type=int
    )
    max_generations_per_request: int = _flag(
        256, "--max-generations-per-request", "prompts x n of one request; more is a 400", up=True, type=int
    )
    # So that stalled bodies cannot grow the gateway's memory without bound.
    max_inflight_body_bytes: int = _flag(
        64 << 20,
        "--max-inflight-body-bytes",
        "bytes of request bodies being received or parsed, over all clients; past it a 429 (default 64 MiB)",
        up=True,
        type=int,
    )
    # Slow clients: neither a body trickling in nor an idle connection holds a slot for ever.
    request_body_timeout_s: float = _flag(
        60.0,
        "--request-body-timeout",
        "seconds for a request body to arrive in full; later is a 408",
        up=True,
        type=float,
    )
    idle_timeout_s: float = _flag(
        30.0,
        "--idle-timeout",
        "seconds a connection may stay open without a request in progress (headers not complete, "
        "or idle between requests)",
        up=True,
        type=float,
    )
    request_timeout_s: float = _flag(600.0, "--request-timeout", "seconds", up=True, type=float)
    # How long the final response waits for a late PrefillDone before stitching without it (no flag).
    prefill_done_grace_s: float = 2.0
    enable_metrics: bool = _flag(
        True, "--enable-metrics", "serve Prometheus metrics on /metrics", negatable=True
    )
    log_level: str = "info"
    # Once both sockets are bound, their ports are written here as JSON (port 0 = any free port).
    port_file: str | None = _flag(
        None,
        "--port-file",
        'write {"port": HTTP port, "control_port": control port} here once both are bound '
        "(use with --port 0 / --control-port 0)",
    )
    # Routing (gateway/cluster/workers.py RoutingPolicy), per role.
    prefill_policy: Policy = _flag(
        "cache_aware",
        "--prefill-policy",
        "how a prefill worker is picked: cache_aware (lowest cache-weight * uncached prompt tokens "
        "+ load-weight * in-flight tokens), round_robin, least_load",
        up=True,
        choices=POLICIES,
    )
    decode_policy: Policy = _flag(
        "cache_aware",
        "--decode-policy",
        "how a decode worker is picked (the same rules; decode workers cache prompts and outputs, "
        "and one that holds a prompt's prefix receives only the pages after it)",
        up=True,
        choices=POLICIES,
    )
    cache_weight: float = _flag(1.0, "--cache-weight", "cache_aware: cost per uncached token", type=float)
    load_weight: float = _flag(1.0, "--load-weight", "cache_aware: cost per in-flight token", type=float)
    # Conditional disaggregation; see RoutingPolicy.
    disaggregation_min_prefill_tokens: int = _flag(
        0,
        "--disaggregation-min-prefill-tokens",
        "conditional disaggregation: a prompt with fewer tokens than this that the chosen decode "
        "worker does not cache is computed on that decode worker, no prefill worker involved (0: off)",
        up=True,
        type=int,
    )
    disaggregation_max_prefill_queue: int = _flag(
        0,
        "--disaggregation-max-prefill-queue",
        "conditional disaggregation: when every prefill worker has more requests in flight than "
        "this, the decode worker computes the prompt (0: off)",
        up=True,
        type=int,
    )
    # Structured output: constraints are compiled here too, so an invalid one is a 400 (xgrammar | none).
    grammar_backend: str = "xgrammar"
    # A constraint's compile runs off the event loop; one that takes longer is a 400 naming the flag.
    grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    # The cluster secret (pdserve/cluster_auth.py); None: PDSERVE_CLUSTER_SECRET, else unauthenticated.
    # Where the secret lives is not shown either.
    cluster_secret_file: str | None = field(default=None, repr=False, metadata=SECRET)
    # HTTP API keys (gateway/api/auth.py); None: that kind of endpoint is open.
    api_key: str | None = _flag(
        None,
        "--api-key",
        "require `Authorization: Bearer <key>` on the inference endpoints (default: $PDSERVE_API_KEY; "
        "prefer the variable: a flag is visible in the process list)",
        up=True,
        secret=True,
        default=env.api_key,
        role_default={UP: None},
    )
    admin_api_key: str | None = _flag(
        None,
        "--admin-api-key",
        "the key of /workers, /flush_cache, /abort_request and /dashboard (default: $PDSERVE_ADMIN_API_KEY; "
        "unset: the API key)",
        up=True,
        secret=True,
        default=env.admin_api_key,
        role_default={UP: None},
    )
    protect_health: bool = _flag(False, "--protect-health", "/health needs the API key too", switch=True)
    protect_metrics: bool = _flag(False, "--protect-metrics", "/metrics needs the API key too", switch=True)
    # OpenTelemetry traces (gateway/generation/tracing.py), SGLang's flag names.
    enable_trace: bool = _flag(
        False,
        "--enable-trace",
        "export one OpenTelemetry trace per request (spans on the gateway's clock) over OTLP",
        up=True,
        switch=True,
    )
    otlp_traces_endpoint: str = _flag(
        "localhost:4317",
        "--otlp-traces-endpoint",
        "the OTLP receiver: host:port for gRPC, http(s)://host:port[/v1/traces] for http/protobuf",
        up=True,
    )
    otlp_traces_protocol: str | None = _flag(
        None,
        "--otlp-traces-protocol",
        "default: http/protobuf for an http(s):// endpoint, else grpc",
        up=True,
        choices=("http/protobuf", "grpc"),
    )
    dashboard_requests: int = _flag(
        200, "--dashboard-requests", "finished requests /dashboard keeps and shows", type=int
    )
    # The elastic controller (gateway/autopilot/elastic.py; its flags: _ELASTIC); None: the split changes only by hand.
    elastic: ElasticConfig | None = None
    canary_interval_s: float = _flag(
        0.0,
        "--canary-interval",
        "every this many seconds, a fixed greedy request on every worker pair, compared with the "
        "pair's first answer; a pair that drifts takes its workers out of rotation (state suspect; 0: off)",
        up=True,
        type=float,
    )


# --elastic-* flag -> ElasticConfig field (each flag's default is the field's).
_ELASTIC = {
    "--elastic-ttft-slo": ("ttft_slo", float, "seconds to the first token the controller aims for"),
    "--elastic-tpot-slo": ("tpot_slo", float, "seconds per output token after the first it aims for"),
    "--elastic-interval": ("interval_s", float, "seconds between its checks"),
    "--elastic-window": ("window_s", float, "seconds of finished requests each check reads"),
    "--elastic-cooldown": ("cooldown_s", float, "seconds after a switch before the next may begin"),
    "--elastic-confirm": ("confirm", int, "checks in a row that must agree before a switch"),
    "--elastic-min-per-role": ("min_per_role", int, "workers each role keeps at least"),
}


def _elastic_rows() -> list[Flag]:
    """--elastic and its settings; `pdserve up` takes them too."""
    d = ElasticConfig()
    rows = [
        Flag(
            "--elastic",
            _GW_UP,
            "move workers between prefill and decode, one at a time, from the measured TTFT/TPOT misses, "
            "prefill queue and decode batch fill (gateway/autopilot/elastic.py)",
            switch=True,
            passed_to=TO_GATEWAY,
        )
    ]
    for flag, (name, kind, text) in _ELASTIC.items():
        rows.append(
            Flag(
                flag,
                _GW_UP,
                f"{text} (default: %(default)s)",
                type=kind,
                default=getattr(d, name),
                dest=f"elastic_{name}",
                passed_to=TO_GATEWAY,
            )
        )
    return rows


def _field_rows() -> list[Flag]:
    """The rows declared on GatewayConfig's fields; each sets its field (argparse's dest is its name)."""
    rows = []
    for f in fields(GatewayConfig):
        row = f.metadata.get("flag")
        if row is not None:
            # The help shows the flag's own name as its value's, not the field's (`_S` and all).
            shown = row.metavar or (None if row.switch or row.negatable else row.attr.upper())
            rows.append(row if row.attr == f.name else replace(row, dest=f.name, metavar=shown))
    return rows


# The gateway's own rows of the flag table (pdserve/launch/flags.py reads them for the gateway and `pdserve up`).
GATEWAY_FLAGS: list[Flag] = _field_rows() + _elastic_rows()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Gateway flags; names follow SGLang's server where one exists."""
    add_flags(parser, GATEWAY)


def elastic_config(args: argparse.Namespace) -> ElasticConfig | None:
    """The controller's settings from parsed flags (None without --elastic); ValueError names a bad one."""
    if not args.elastic:
        return None
    return ElasticConfig(**{name: getattr(args, f"elastic_{name}") for name, _, _ in _ELASTIC.values()})


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """Every field a flag sets (a row's namespace name is its field's), and the elastic controller's."""
    names = {f.name for f in fields(GatewayConfig)} & {row.attr for row in flags_of(GATEWAY)}
    return GatewayConfig(**{n: getattr(args, n) for n in names - {"elastic"}}, elastic=elastic_config(args))


def public_config(cfg: Any) -> dict[str, Any]:
    """A config dataclass as a dict fit to show (an HTTP response, a log line): every field but the
    secret ones (`metadata=SECRET`), nested dataclasses likewise. Every config dump goes through here."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        if f.metadata.get("secret"):
            continue
        value = getattr(cfg, f.name)
        out[f.name] = public_config(value) if is_dataclass(value) and not isinstance(value, type) else value
    return out
