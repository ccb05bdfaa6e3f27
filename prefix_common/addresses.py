"""Worker and listener addresses: URL normalization, ``host:port`` parsing, IP resolution, free ports.

One module, because every part of the project names workers and sockets the same way: the router
(worker URLs, KV-event hosts), the Envoy config generator (``host:port``), the local stack, the
simulated worker launcher and the tests (free loopback ports).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from urllib.parse import urlsplit

__all__ = [
    "LOOPBACK",
    "WILDCARD_HOSTS",
    "free_port",
    "free_port_run",
    "free_ports",
    "is_ip_literal",
    "is_loopback",
    "parse_worker_url",
    "port_in_use",
    "resolve_endpoint",
    "split_host_port",
    "substitute_wildcard",
    "url_port",
]

LOOPBACK = "127.0.0.1"

# Bind-all addresses a worker may report for its own sockets (e.g. ``tcp://*:5557``): a client must
# connect to the worker's own host instead.
WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is an IP address (no brackets), not a name to resolve."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether a bind address only this host can reach (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it may resolve to anything
        return False


def parse_worker_url(value: str) -> str:
    """``host:port`` or a URL -> a normalized base URL (``http://`` by default, no trailing slash)."""
    value = value.strip().rstrip("/")
    return value if value.startswith(("http://", "https://")) else "http://" + value


def split_host_port(value: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or a URL -> (host, port)."""
    parts = urlsplit(parse_worker_url(value))
    try:
        port = parts.port or default_port
    except ValueError:  # a port that is not a number, or out of range
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"expected host:port, got {value!r}")
    return parts.hostname, port


def url_port(url: str) -> int:
    """The port of ``http(s)://host[:port]``: the one given, else the scheme's."""
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def resolve_endpoint(url: str) -> tuple[str, int]:
    """``http://host:port`` -> (ip, port); Envoy's ORIGINAL_DST accepts only IP literals."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r} has no host")
    port = url_port(url)
    ip = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)[0][4][0]
    return str(ip), port


def substitute_wildcard(host: str | None, fallback: str) -> str:
    """A host to connect to: ``fallback`` for a wildcard bind address; IPv6 literals bracketed."""
    if host is None or host.strip("[]") in WILDCARD_HOSTS or host in WILDCARD_HOSTS:
        host = fallback
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct TCP ports the OS reports free right now (bound together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_in_use(host: str, port: int) -> bool:
    """Something already listens on ``host:port`` (a bind there fails with EADDRINUSE).

    Asked just before a server binds, so the refusal is ours to word: gRPC's C core would otherwise print its own
    line to stderr, outside the log format the operator chose. Binds as servers do (``SO_REUSEADDR``), so a port
    left in TIME_WAIT counts as free. Any other failure (an address not on this host) is left to the server.
    """
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def free_port(host: str = LOOPBACK) -> int:
    """One TCP port free on ``host`` right now."""
    return free_ports(1, host)[0]


def free_port_run(count: int, host: str = LOOPBACK) -> int:
    """The first of ``count`` consecutive TCP ports free on ``host`` right now (``serve --processes N`` takes a run)."""
    for _ in range(50):
        base = free_port(host)
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return base
    raise RuntimeError(f"no run of {count} free ports on {host}")
