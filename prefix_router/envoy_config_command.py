"""``prefix-router envoy-config``: print the Envoy pieces (or a whole bootstrap) for your own Envoy."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefix_common.addresses import split_host_port
from prefix_router.envoy_config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MESSAGE_TIMEOUT_MS,
    GatewaySpec,
    bootstrap,
    dump,
    pieces,
)

__all__ = ["configure", "main", "spec_from_args"]

DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_ADMIN = "127.0.0.1:9901"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        required=True,
        help="A worker (host:port or URL); repeat for each. Used by the fail-open cluster.",
    )
    parser.add_argument(
        "--extproc", default="127.0.0.1:9002", metavar="HOST:PORT", help="Where `prefix-router serve` listens."
    )
    parser.add_argument(
        "--router-processes",
        type=int,
        default=1,
        metavar="N",
        help=(
            "The router runs `prefix-router serve --processes N`: list its N ports (the --extproc port and the "
            "N - 1 after it) and balance ext_proc streams over them round robin."
        ),
    )
    parser.add_argument(
        "--router-metrics",
        metavar="HOST:PORT",
        help=(
            "The router's metrics port: the gateway's GET /metrics then shows the router's figures and every "
            "worker's (labelled worker=...). Without it the gateway answers /metrics with a clear 404."
        ),
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help=(
            "Retries of a request whose worker refused the connection (nothing reached it): on the router's "
            "next fallback endpoint, then on any worker."
        ),
    )
    parser.add_argument(
        "--no-retry-on-reset",
        action="store_true",
        help=(
            "Retry only refused connections, not requests whose worker reset the connection before answering "
            "(a dying worker's last accepted requests then fail; a request that itself crashes workers cannot "
            "crash a second one)."
        ),
    )
    parser.add_argument(
        "--timeout-ms", type=int, default=500, help="ext_proc message timeout; a slower router is bypassed (fail-open)."
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="The router's body limit; Envoy's buffer limit is set to twice this.",
    )
    parser.add_argument(
        "--upstream-host-header",
        action="store_true",
        help="Add an x-upstream-host response header naming the worker that served.",
    )
    parser.add_argument("--tls-ca", type=Path, help="Talk TLS to the router, verifying it with this CA bundle.")
    parser.add_argument("--tls-cert", type=Path, help="Client certificate for mTLS to the router.")
    parser.add_argument("--tls-key", type=Path, help="Private key of --tls-cert.")
    parser.add_argument("--tls-sni", help="SNI / expected name of the router's certificate (with --tls-ca).")
    parser.add_argument(
        "--bootstrap", action="store_true", help="Print a complete Envoy bootstrap instead of the drop-in pieces."
    )
    parser.add_argument(
        "--listen", metavar="HOST:PORT", help=f"Listener address (with --bootstrap; default {DEFAULT_LISTEN})."
    )
    parser.add_argument(
        "--admin", metavar="HOST:PORT", help=f"Admin address (with --bootstrap; default {DEFAULT_ADMIN})."
    )
    parser.add_argument(
        "--access-log", action="store_true", help="Log each request and its upstream (with --bootstrap)."
    )
    parser.add_argument(
        "--health-path",
        default="/ready",
        help=(
            "Path of Envoy's health check of the workers (fail-open cluster): SGLang's /ready is a flag and costs "
            "the worker nothing; use /health (a one-token generation, >= 1 s) for releases without /ready."
        ),
    )
    parser.add_argument(
        "--body-mode",
        choices=["buffered", "streamed"],
        default="buffered",
        help=(
            "How Envoy hands bodies to the router: buffered (whole request body in one message, responses not "
            "sent) or streamed (FULL_DUPLEX_STREAMED both ways, as GIE gateways configure an endpoint picker)."
        ),
    )
    parser.add_argument(
        "--max-message-timeout-ms",
        type=int,
        default=DEFAULT_MAX_MESSAGE_TIMEOUT_MS,
        help=(
            "Longest wait the router may ask Envoy for while a request waits in its flow control "
            "(ext_proc max_message_timeout; default 35000, above flow_control.queue_ttl_s' default of 30 s "
            "plus 1 s). Until the router asks, message_timeout (--timeout-ms) applies."
        ),
    )
    parser.add_argument(
        "--disaggregated",
        action="store_true",
        help=(
            "The workers are prefill/decode pairs: a generation request the router did not pair (it is down or "
            "slower than --timeout-ms) is answered 503 at once, since a PD worker refuses one without bootstrap "
            "fields (400); other paths still pass through."
        ),
    )
    parser.add_argument("-o", "--output", type=Path, help="Write to this file instead of stdout.")


def spec_from_args(args: argparse.Namespace) -> GatewaySpec:
    """The spec the flags describe; a ValueError for a flag that contradicts or would be ignored."""
    if not args.bootstrap:  # the drop-in pieces have no listener, admin or access log: say so, do not drop them
        ignored = [flag for flag, value in (("--listen", args.listen), ("--admin", args.admin)) if value is not None]
        ignored += ["--access-log"] if args.access_log else []
        if ignored:
            raise ValueError(f"{', '.join(ignored)} only apply to a whole bootstrap: add --bootstrap")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_sni and args.tls_ca is None:
        raise ValueError("--tls-sni names the router's certificate, which only --tls-ca verifies: add --tls-ca")
    if args.router_processes < 1:
        raise ValueError("--router-processes must be at least 1")
    return GatewaySpec(
        workers=[split_host_port(w) for w in args.worker],
        extproc=split_host_port(args.extproc),
        extproc_processes=args.router_processes,
        router_metrics=split_host_port(args.router_metrics) if args.router_metrics else None,
        retries=args.retries,
        retry_on_reset=not args.no_retry_on_reset,
        listen=split_host_port(args.listen or DEFAULT_LISTEN),
        admin=split_host_port(args.admin or DEFAULT_ADMIN),
        timeout_ms=args.timeout_ms,
        max_body_bytes=args.max_body_bytes,
        upstream_host_header=args.upstream_host_header,
        access_log=args.access_log,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_sni=args.tls_sni,
        health_path=args.health_path,
        body_mode=args.body_mode,
        max_message_timeout_ms=args.max_message_timeout_ms,
        disaggregated=args.disaggregated,
    )


def main(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"prefix-router envoy-config: {exc}", file=sys.stderr)
        return 2
    if args.bootstrap:
        text = "# Envoy bootstrap generated by `prefix-router envoy-config --bootstrap`.\n" + dump(bootstrap(spec))
    else:
        text = (
            "# Drop-in pieces generated by `prefix-router envoy-config` (see docs/gateway.md).\n"
            "# http_filters: your HCM's filter chain (header_mutation and ext_proc go before the router filter).\n"
            "# clusters: add to static_resources.clusters. routes: your virtual host's routes, in this order.\n"
            "# local_reply_config (optional): your HCM's; makes Envoy's own errors OpenAI-style JSON.\n"
            + dump(pieces(spec))
        )
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0
