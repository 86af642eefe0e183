"""Gateway configuration: one frozen dataclass, built once from the command line."""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from pdserve import env
from pdserve.cluster_auth import add_secret_arg
from pdserve.config import GRAMMAR_COMPILE_TIMEOUT_S
from pdserve.gateway.elastic import ElasticConfig
from pdserve.gateway.function_call import PARSER_NAMES
from pdserve.gateway.reasoning import REASONING_PARSERS
from pdserve.gateway.workers import POLICIES, Policy

# A config field with this metadata is never shown: not in its repr, not in `public_config`.
SECRET = types.MappingProxyType({"secret": True})


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 30000
    # Where the control-plane ROUTER socket binds; workers connect DEALER sockets here.
    control_host: str = "127.0.0.1"
    control_port: int = 30001
    # None: the bundled default model (only its tokenizer is loaded here).
    model_path: str | None = None
    # None: the model's own name (model_source.model_name).
    served_model_name: str | None = None
    # Tool-call format (gateway/function_call/): None means hermes when a request has tools.
    tool_call_parser: str | None = None
    # Reasoning format (gateway/reasoning.py): None leaves thinking text in content.
    reasoning_parser: str | None = None
    # A chat completion's `metadata` as the seed has it (the per-token `weight_versions` inside), or,
    # strict, a map of strings as OpenAI types it (`weight_versions` beside it, at the top level).
    strict_openai_metadata: bool = False
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    # Generations (prompts x n) in flight beyond this are refused at once with 503 + Retry-After.
    max_pending_generations: int = 512
    # HTTP generation requests in flight per client (its API key, else its address): 429 beyond (0: no limit).
    max_requests_per_client: int = 256
    # One request's limits: its body, and the generations it asks for (prompts x n).
    # 4 MiB: nginx's default is 1 MiB; a body's JSON is parsed whole, and a 4 MiB one of the costliest
    # shape (a million empty lists) takes about 0.1 s to parse.
    max_request_bytes: int = 4 << 20
    max_generations_per_request: int = 256
    # Bytes of request bodies being received or parsed, over all requests: past it a 429, so that
    # stalled bodies cannot grow the gateway's memory without bound.
    max_inflight_body_bytes: int = 64 << 20
    # Slow clients: a body not all arrived within this is a 408; a connection with no request in
    # progress (no complete headers yet, or idle between requests) is closed after idle_timeout_s.
    request_body_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    # How long the final response waits for a late PrefillDone before stitching without it.
    prefill_done_grace_s: float = 2.0
    enable_metrics: bool = True
    log_level: str = "info"
    # Once both sockets are bound, their ports are written here as JSON (port 0 = any free port).
    port_file: str | None = None
    # Routing (gateway/workers.py RoutingPolicy): cache_aware | round_robin | least_load, per role.
    prefill_policy: Policy = "cache_aware"
    decode_policy: Policy = "cache_aware"
    cache_weight: float = 1.0
    load_weight: float = 1.0
    # Conditional disaggregation (0: off); see RoutingPolicy.
    disaggregation_min_prefill_tokens: int = 0
    disaggregation_max_prefill_queue: int = 0
    # Structured output: constraints are compiled here too, so an invalid one is a 400 (xgrammar | none).
    grammar_backend: str = "xgrammar"
    # A constraint's compile runs off the event loop; one that takes longer is a 400 naming the flag.
    grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    # The cluster secret (pdserve/cluster_auth.py); None: PDSERVE_CLUSTER_SECRET, else unauthenticated.
    # Where the secret lives is not shown either.
    cluster_secret_file: str | None = field(default=None, repr=False, metadata=SECRET)
    # HTTP API keys (gateway/auth.py); None: that kind of endpoint is open.
    api_key: str | None = field(default=None, repr=False, metadata=SECRET)
    admin_api_key: str | None = field(default=None, repr=False, metadata=SECRET)
    protect_health: bool = False
    protect_metrics: bool = False
    # OpenTelemetry traces (gateway/tracing.py), SGLang's flag names; the protocol None: from the endpoint.
    enable_trace: bool = False
    otlp_traces_endpoint: str = "localhost:4317"
    otlp_traces_protocol: str | None = None
    # Finished requests the dashboard keeps (gateway/dashboard.py).
    dashboard_requests: int = 200
    # The elastic controller (gateway/elastic.py, --elastic); None: the split changes only by hand.
    elastic: ElasticConfig | None = None
    # Seconds between canary rounds (gateway/canary.py); 0: no canaries.
    canary_interval_s: float = 0.0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Gateway flags; names follow SGLang's server where one exists."""
    d = GatewayConfig()
    _add_serving_args(parser, d)
    _add_access_args(parser, d)
    _add_limit_args(parser, d)
    _add_routing_args(parser, d)
    _add_grammar_args(parser, d)
    add_trace_args(parser)
    add_elastic_args(parser)
    parser.add_argument(
        "--dashboard-requests",
        type=int,
        default=d.dashboard_requests,
        help="finished requests /dashboard keeps and shows",
    )
    parser.add_argument(
        "--canary-interval",
        type=float,
        default=d.canary_interval_s,
        dest="canary_interval_s",
        help="every this many seconds, a fixed greedy request on every worker pair, compared with the "
        "pair's first answer; a pair that drifts takes its workers out of rotation (state suspect; 0: off)",
    )


def _add_serving_args(parser: argparse.ArgumentParser, d: GatewayConfig) -> None:
    """The model, the sockets, the output parsers, metrics and logging."""
    parser.add_argument(
        "--model-path", default=d.model_path, help="tokenizer source (default: bundled model)"
    )
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument(
        "--served-model-name",
        default=d.served_model_name,
        help="the name clients send as `model` (default: the model's own: the bundled model's Hugging Face "
        "id, else --model-path)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=d.tool_call_parser,
        choices=PARSER_NAMES,
        help="how tool calls are found in the model's output (SGLang's names; default: hermes)",
    )
    parser.add_argument(
        "--strict-openai-metadata",
        action="store_true",
        help="a completion's `metadata` holds strings only, as OpenAI types it (the per-token "
        "`weight_versions` move beside it): for clients that validate it, e.g. the openai Python client",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=d.reasoning_parser,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> text into reasoning_content (default: off)",
    )
    parser.add_argument(
        "--enable-metrics",
        action=argparse.BooleanOptionalAction,
        default=d.enable_metrics,
        help="serve Prometheus metrics on /metrics",
    )
    parser.add_argument(
        "--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument(
        "--control-host",
        default=d.control_host,
        help="bind address of the worker (control) socket; 0.0.0.0 when workers run on other hosts",
    )
    parser.add_argument("--control-port", type=int, default=d.control_port)
    parser.add_argument(
        "--port-file",
        default=d.port_file,
        help='write {"port": HTTP port, "control_port": control port} here once both are bound '
        "(use with --port 0 / --control-port 0)",
    )


def _add_access_args(parser: argparse.ArgumentParser, d: GatewayConfig) -> None:
    """The cluster secret and the HTTP API keys."""
    add_secret_arg(parser)
    parser.add_argument(
        "--api-key",
        default=env.api_key(),
        help="require `Authorization: Bearer <key>` on the inference endpoints (default: $PDSERVE_API_KEY; "
        "prefer the variable: a flag is visible in the process list)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=env.admin_api_key(),
        help="the key of /workers, /flush_cache, /abort_request and /dashboard (default: $PDSERVE_ADMIN_API_KEY; "
        "unset: the API key)",
    )
    parser.add_argument("--protect-health", action="store_true", help="/health needs the API key too")
    parser.add_argument("--protect-metrics", action="store_true", help="/metrics needs the API key too")


def _add_limit_args(parser: argparse.ArgumentParser, d: GatewayConfig) -> None:
    """Heartbeats, timeouts, and what requests and clients may have in flight."""
    parser.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s)
    parser.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s)
    parser.add_argument(
        "--max-pending-generations",
        "--max-pending-requests",
        dest="max_pending_generations",
        type=int,
        default=d.max_pending_generations,
        help="generations (prompts x n, over all requests) in flight; more is a 503 with Retry-After",
    )
    parser.add_argument(
        "--max-requests-per-client",
        type=int,
        default=d.max_requests_per_client,
        help="generation requests in flight per client (its API key, else its IP address); more is a 429 "
        "(0: no limit)",
    )
    parser.add_argument(
        "--request-body-timeout",
        type=float,
        default=d.request_body_timeout_s,
        help="seconds for a request body to arrive in full; later is a 408",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        help="seconds a connection may stay open without a request in progress (headers not complete, "
        "or idle between requests)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=d.max_request_bytes,
        help="a larger body is a 413 (default 4 MiB)",
    )
    parser.add_argument(
        "--max-inflight-body-bytes",
        type=int,
        default=d.max_inflight_body_bytes,
        help="bytes of request bodies being received or parsed, over all clients; past it a 429 "
        "(default 64 MiB)",
    )
    parser.add_argument(
        "--max-generations-per-request",
        type=int,
        default=d.max_generations_per_request,
        help="prompts x n of one request; more is a 400",
    )
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout_s, help="seconds")


def _add_routing_args(parser: argparse.ArgumentParser, d: GatewayConfig) -> None:
    """How workers are picked, and when a decode worker computes the prompt itself."""
    parser.add_argument(
        "--prefill-policy",
        default=d.prefill_policy,
        choices=POLICIES,
        help="how a prefill worker is picked: cache_aware (lowest cache-weight * uncached prompt tokens "
        "+ load-weight * in-flight tokens), round_robin, least_load",
    )
    parser.add_argument(
        "--decode-policy",
        default=d.decode_policy,
        choices=POLICIES,
        help="how a decode worker is picked (the same rules; decode workers cache prompts and outputs, "
        "and one that holds a prompt's prefix receives only the pages after it)",
    )
    parser.add_argument(
        "--disaggregation-min-prefill-tokens",
        type=int,
        default=d.disaggregation_min_prefill_tokens,
        help="conditional disaggregation: a prompt with fewer tokens than this that the chosen decode "
        "worker does not cache is computed on that decode worker, no prefill worker involved (0: off)",
    )
    parser.add_argument(
        "--disaggregation-max-prefill-queue",
        type=int,
        default=d.disaggregation_max_prefill_queue,
        help="conditional disaggregation: when every prefill worker has more requests in flight than "
        "this, the decode worker computes the prompt (0: off)",
    )
    parser.add_argument(
        "--cache-weight", type=float, default=d.cache_weight, help="cache_aware: cost per uncached token"
    )
    parser.add_argument(
        "--load-weight", type=float, default=d.load_weight, help="cache_aware: cost per in-flight token"
    )


def _add_grammar_args(parser: argparse.ArgumentParser, d: GatewayConfig) -> None:
    """Structured output's validation."""
    parser.add_argument(
        "--grammar-backend",
        default=d.grammar_backend,
        choices=["xgrammar", "none"],
        help="validates json_schema / regex / ebnf / response_format constraints; none: refuse them",
    )
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=d.grammar_compile_timeout_s,
        help="seconds a constraint's grammar may take to compile; a request whose grammar takes longer "
        "is a 400",
    )


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    """The tracing flags (SGLang's names); `pdserve up` takes them too."""
    d = GatewayConfig()
    parser.add_argument(
        "--enable-trace",
        action="store_true",
        help="export one OpenTelemetry trace per request (spans on the gateway's clock) over OTLP",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=d.otlp_traces_endpoint,
        help="the OTLP receiver: host:port for gRPC, http(s)://host:port[/v1/traces] for http/protobuf",
    )
    parser.add_argument(
        "--otlp-traces-protocol",
        default=d.otlp_traces_protocol,
        choices=["http/protobuf", "grpc"],
        help="default: http/protobuf for an http(s):// endpoint, else grpc",
    )


# --elastic-* flag -> ElasticConfig field (each flag's default is the field's).
ELASTIC_FLAGS = {
    "--elastic-ttft-slo": ("ttft_slo", float, "seconds to the first token the controller aims for"),
    "--elastic-tpot-slo": ("tpot_slo", float, "seconds per output token after the first it aims for"),
    "--elastic-interval": ("interval_s", float, "seconds between its checks"),
    "--elastic-window": ("window_s", float, "seconds of finished requests each check reads"),
    "--elastic-cooldown": ("cooldown_s", float, "seconds after a switch before the next may begin"),
    "--elastic-confirm": ("confirm", int, "checks in a row that must agree before a switch"),
    "--elastic-min-per-role": ("min_per_role", int, "workers each role keeps at least"),
}


def add_elastic_args(parser: argparse.ArgumentParser) -> None:
    """The elastic controller's flags; `pdserve up` takes them too."""
    d = ElasticConfig()
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="move workers between prefill and decode, one at a time, from the measured TTFT/TPOT misses, "
        "prefill queue and decode batch fill (gateway/elastic.py)",
    )
    for flag, (name, kind, text) in ELASTIC_FLAGS.items():
        parser.add_argument(
            flag,
            dest=f"elastic_{name}",
            type=kind,
            default=getattr(d, name),
            help=f"{text} (default: %(default)s)",
        )


def elastic_flags(args: argparse.Namespace) -> list[str]:
    """The elastic flags of a parsed `pdserve up`, for its gateway (none without --elastic)."""
    if not args.elastic:
        return []
    out = ["--elastic"]
    for flag, (name, _, _) in ELASTIC_FLAGS.items():
        out += [flag, str(getattr(args, f"elastic_{name}"))]
    return out


def elastic_config(args: argparse.Namespace) -> ElasticConfig | None:
    """The controller's settings from parsed flags (None without --elastic); ValueError names a bad one."""
    if not args.elastic:
        return None
    return ElasticConfig(**{name: getattr(args, f"elastic_{name}") for name, _, _ in ELASTIC_FLAGS.values()})


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        control_host=args.control_host,
        control_port=args.control_port,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        strict_openai_metadata=args.strict_openai_metadata,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        max_pending_generations=args.max_pending_generations,
        max_requests_per_client=args.max_requests_per_client,
        request_body_timeout_s=args.request_body_timeout,
        idle_timeout_s=args.idle_timeout,
        max_request_bytes=args.max_request_bytes,
        max_inflight_body_bytes=args.max_inflight_body_bytes,
        max_generations_per_request=args.max_generations_per_request,
        request_timeout_s=args.request_timeout,
        enable_metrics=args.enable_metrics,
        log_level=args.log_level,
        port_file=args.port_file,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        disaggregation_min_prefill_tokens=args.disaggregation_min_prefill_tokens,
        disaggregation_max_prefill_queue=args.disaggregation_max_prefill_queue,
        cache_weight=args.cache_weight,
        load_weight=args.load_weight,
        grammar_backend=args.grammar_backend,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        cluster_secret_file=args.cluster_secret_file,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        protect_health=args.protect_health,
        protect_metrics=args.protect_metrics,
        enable_trace=args.enable_trace,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        otlp_traces_protocol=args.otlp_traces_protocol,
        dashboard_requests=args.dashboard_requests,
        elastic=elastic_config(args),
        canary_interval_s=args.canary_interval_s,
    )


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
