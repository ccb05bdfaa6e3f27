"""Where the worker set comes from, kept live: configured workers, DNS names, the config file, Kubernetes pods.

``WorkerSources`` computes the desired set and hands it to ``WorkerRegistry.reconcile``, which keeps
every unchanged worker (its health, load and index) and adds or drops the rest:

- ``workers:`` entries are resolved again every ``discovery.dns_interval_s``: one worker each,
  following its name to a new address (a restarted pod, a rescheduled compose service);
- ``discovery.dns`` names: every address of the name is a worker (compose services with replicas,
  Kubernetes headless Services), so workers join and leave as the name's records do;
- the ``--config`` file is read again when its modification time changes, or at once on SIGHUP;
  changed ``workers:`` and ``discovery.dns`` apply live, other changes are logged as needing a restart;
- ``discovery.kubernetes``: the ready pods of a label selector, watched with the official client
  (in a thread: the client blocks), one worker per pod IP.

A name that cannot be resolved right now (timeout, server failure) keeps the workers it had; only an
answer that the name has no address (NXDOMAIN, no records) removes them. New workers start out of the
candidate set: the health checker takes them in after their first good ``/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from extproc.config import (
    ConfigError,
    DiscoveryConfig,
    DnsWorkersConfig,
    KubernetesDiscoveryConfig,
    RouterConfig,
    WorkerConfig,
)
from extproc.fleet.workers import Worker, WorkerRegistry
from prefix_common.addresses import is_ip_literal, url_port

__all__ = ["Resolver", "WorkerSources", "pod_worker"]

log = logging.getLogger(__name__)


class Resolver:
    """Every address of a name: the system resolver, or the configured DNS servers (dnspython)."""

    def __init__(self, nameservers: list[str], timeout_s: float = 2.0) -> None:
        self.nameservers = nameservers
        self.timeout_s = timeout_s
        self._resolver: Any = None
        if nameservers:
            import dns.asyncresolver

            resolver = dns.asyncresolver.Resolver(configure=False)
            ips, ports = [], set()
            for server in nameservers:
                host, sep, port = server.rpartition(":") if server.count(":") == 1 else ("", "", "")
                ips.append(host if sep else server.strip("[]"))
                ports.add(int(port) if sep and port.isdigit() else 53)
            if len(ports) > 1:
                raise ConfigError("discovery.nameservers: all servers must use one port")
            resolver.nameservers = ips
            resolver.port = ports.pop()
            resolver.lifetime = timeout_s
            self._resolver = resolver

    async def addresses(self, host: str, port: int) -> list[str] | None:
        """Sorted addresses of ``host``; ``[]`` when it has none, ``None`` when the lookup failed."""
        if is_ip_literal(host.strip("[]")):
            return [host.strip("[]")]
        if self._resolver is not None:
            return await self._dns(host)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []
            log.warning("cannot resolve %s: %s (keeping its workers)", host, exc)
            return None
        return sorted({str(info[4][0]) for info in infos})

    async def _dns(self, host: str) -> list[str] | None:
        import dns.exception
        import dns.resolver

        found: set[str] = set()
        answered = False
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(host, rdtype, search=False)
            except dns.resolver.NXDOMAIN:
                return []
            except dns.resolver.NoAnswer:
                answered = True
                continue
            except (dns.exception.Timeout, dns.resolver.NoNameservers) as exc:
                log.warning("cannot resolve %s (%s): %s (keeping its workers)", host, rdtype, exc)
                continue
            answered = True
            found.update(str(record.address) for record in answer)
        return sorted(found) if answered else None


def pod_worker(pod: Any, config: KubernetesDiscoveryConfig) -> Worker | None:
    """The worker a pod is (a ``V1Pod``), or None while it is not a ready, running pod with an IP."""
    status = pod.status
    if pod.metadata is None or status is None or pod.metadata.deletion_timestamp is not None:
        return None
    if status.phase != "Running" or not status.pod_ip:
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())
    if not ready:
        return None
    ip = status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip
    return Worker(id=pod.metadata.name, url=f"{config.scheme}://{host}:{config.port}", ip=ip, port=config.port)


class _KubernetesWatch:
    """The ready pods of a label selector, kept by a watch running in a daemon thread."""

    def __init__(self, config: KubernetesDiscoveryConfig, changed: Callable[[], None]) -> None:
        self.config = config
        self.changed = changed
        self.pods: dict[str, Worker] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            from kubernetes import client
            from kubernetes import config as kube_config
        except ImportError as exc:
            raise ConfigError("discovery.kubernetes needs the kubernetes package: pip install kubernetes") from exc
        try:
            if self.config.kubeconfig is not None:
                kube_config.load_kube_config(config_file=str(self.config.kubeconfig))
            else:
                try:
                    kube_config.load_incluster_config()
                except kube_config.ConfigException:
                    kube_config.load_kube_config()
        except Exception as exc:  # the client raises ConfigException or OSError for a missing/bad config
            raise ConfigError(f"discovery.kubernetes: cannot load a Kubernetes config: {exc}") from exc
        namespace = self.config.namespace or _own_namespace()
        api = client.CoreV1Api()
        self._thread = threading.Thread(target=self._run, args=(api, namespace), daemon=True, name="k8s-pods")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, api: Any, namespace: str) -> None:
        from kubernetes import watch

        selector = self.config.label_selector
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_pod(namespace, label_selector=selector)
                self.pods = {w.id: w for pod in listed.items if (w := pod_worker(pod, self.config)) is not None}
                self.changed()
                stream = watch.Watch().stream(
                    api.list_namespaced_pod,
                    namespace,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=60,
                )
                for event in stream:
                    if self._stop.is_set():
                        return
                    self.apply(event["type"], event["object"])
            except Exception as exc:  # API server away, watch expired (410): list again after a pause
                log.warning("kubernetes pod watch (%s in %s): %s; retrying", selector, namespace, exc)
                self._stop.wait(2.0)

    def apply(self, kind: str, pod: Any) -> None:
        """One watch event (ADDED / MODIFIED / DELETED) applied to the pod set."""
        name = pod.metadata.name if pod.metadata is not None else None
        if name is None:
            return
        worker = None if kind == "DELETED" else pod_worker(pod, self.config)
        previous = self.pods.get(name)
        if worker is None:
            if self.pods.pop(name, None) is not None:
                self.changed()
        elif previous is None or (previous.ip, previous.port) != (worker.ip, worker.port):
            self.pods[name] = worker
            self.changed()


def _own_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    with contextlib.suppress(OSError):
        return path.read_text().strip() or "default"
    return "default"


class WorkerSources:
    """Keeps ``registry`` equal to what the configuration, DNS and Kubernetes say the workers are."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        config_path: Path | None = None,
        reload: Callable[[], RouterConfig] | None = None,
    ) -> None:
        self.registry = registry
        self.config_path = config_path
        self.reload_config = reload
        self.workers: list[WorkerConfig] = list(config.workers)
        self.discovery: DiscoveryConfig = config.discovery
        self._config = config
        self.resolver = Resolver(config.discovery.nameservers)
        self._resolved: dict[str, list[Worker]] = {}  # source key -> its last good workers
        self._nameless: set[str] = set()  # source keys whose name had no address at the last look (said once)
        self._kubernetes: _KubernetesWatch | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._reload_now = asyncio.Event()
        self._mtime = self._stat()
        self.reloads = 0

    @property
    def dynamic(self) -> bool:
        """Whether anything here can change the worker set after start-up."""
        names = any(not is_ip_literal(urlsplit(w.url).hostname or "") for w in self.workers)
        return bool(names or self.discovery.dns or self.discovery.kubernetes or self._watching_file)

    @property
    def _watching_file(self) -> bool:
        return self.config_path is not None and self.reload_config is not None and self.discovery.reload_config

    async def start(self) -> None:
        """Resolve everything once (the registry is then complete before health checks start), then follow."""
        if self.discovery.kubernetes is not None:
            loop = asyncio.get_running_loop()

            def changed() -> None:  # called on the watch thread
                loop.call_soon_threadsafe(self.wake)

            self._kubernetes = _KubernetesWatch(self.discovery.kubernetes, changed)
            self._kubernetes.start()
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._follow(), name="worker-sources"))
        if self._watching_file:
            self._tasks.append(asyncio.create_task(self._watch_file(), name="config-reload"))

    async def stop(self) -> None:
        if self._kubernetes is not None:
            self._kubernetes.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def wake(self) -> None:
        """Recompute the worker set now (a Kubernetes event arrived)."""
        self._wake.set()

    def reload_soon(self) -> None:
        """Read the config file again now (SIGHUP)."""
        self._reload_now.set()

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.discovery.dns_interval_s)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # discovery must never die; the next round retries
                log.exception("worker discovery failed")

    async def refresh(self) -> None:
        """Compute the desired worker set from every source and apply it."""
        desired: list[Worker] = []
        for entry in self.workers:
            desired.extend(await self._static(entry))
        for name in self.discovery.dns:
            desired.extend(await self._dns(name))
        if self._kubernetes is not None:
            desired.extend(sorted(self._kubernetes.pods.values(), key=lambda w: w.id))
        seen: set[str] = set()
        unique = [w for w in desired if not (w.id in seen or seen.add(w.id))]  # type: ignore[func-returns-value]
        added, removed = self.registry.reconcile(unique)
        for worker in added:
            log.info("worker %s joined at %s", worker.id, worker.endpoint)
        for worker in removed:
            log.info("worker %s left (%s)", worker.id, worker.endpoint)

    async def _static(self, entry: WorkerConfig) -> list[Worker]:
        host, port = urlsplit(entry.url).hostname or "", url_port(entry.url)
        key = f"workers:{entry.url}:{entry.name}"
        addresses = await self.resolver.addresses(host, port)
        self._note_addresses(key, f"worker {entry.url}", host, addresses)
        if addresses is None or not addresses:
            return self._resolved.get(key, []) if addresses is None else []
        worker = Worker.from_config(entry, addresses[0])
        self._resolved[key] = [worker]
        return [worker]

    async def _dns(self, name: DnsWorkersConfig) -> list[Worker]:
        key = f"dns:{name.scheme}://{name.host}:{name.port}"
        addresses = await self.resolver.addresses(name.host, name.port)
        self._note_addresses(key, "discovery.dns", name.host, addresses)
        if addresses is None:
            return self._resolved.get(key, [])
        workers = []
        for ip in addresses:
            host = f"[{ip}]" if ":" in ip else ip
            workers.append(
                Worker(
                    id=f"{name.host}/{host}:{name.port}",
                    url=f"{name.scheme}://{host}:{name.port}",
                    ip=ip,
                    port=name.port,
                    model=name.model,
                    role=name.role,
                )
            )
        self._resolved[key] = workers
        return workers

    def _note_addresses(self, key: str, what: str, host: str, addresses: list[str] | None) -> None:
        """Say once that a name has no address (a typo, a service not created yet), and once when it has again.

        Without this a misspelt ``--worker`` left the router running with "0/0 workers healthy" and no hint.
        """
        if addresses == [] and key not in self._nameless:
            self._nameless.add(key)
            log.warning(
                "%s: the name %s does not resolve (no address); no requests go there until it does "
                "(looked up again every %gs)",
                what,
                host,
                self.discovery.dns_interval_s,
            )
        elif addresses and key in self._nameless:
            self._nameless.discard(key)
            log.info("%s: the name %s resolves again (%s)", what, host, ", ".join(addresses))

    # -- the config file --------------------------------------------------------------------------
    def _stat(self) -> float | None:
        if self.config_path is None:
            return None
        try:
            return self.config_path.stat().st_mtime
        except OSError:
            return None

    async def _watch_file(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reload_now.wait(), self.discovery.reload_interval_s)
            forced = self._reload_now.is_set()
            self._reload_now.clear()
            mtime = self._stat()
            if forced or mtime != self._mtime:
                self._mtime = mtime
                await self.reload(reason="SIGHUP" if forced else "file changed")

    async def reload(self, reason: str = "reload") -> bool:
        """Read the config again; apply its workers and DNS names. False (old set kept) if it is invalid."""
        assert self.reload_config is not None
        try:
            fresh = self.reload_config()
        except (ConfigError, ValueError) as exc:
            log.error("config reload (%s) failed, keeping the running configuration: %s", reason, exc)
            return False
        self.reloads += 1
        old, self._config = self._config, fresh
        changed = [
            name
            for name in type(fresh).model_fields
            if name not in ("workers", "discovery") and getattr(old, name) != getattr(fresh, name)
        ]
        if changed:
            log.warning("config reload (%s): changes to %s take effect after a restart", reason, ", ".join(changed))
        live = ("dns", "dns_interval_s")
        if any(getattr(old.discovery, n) != getattr(fresh.discovery, n) for n in type(fresh.discovery).model_fields):
            if any(
                getattr(old.discovery, n) != getattr(fresh.discovery, n)
                for n in type(fresh.discovery).model_fields
                if n not in live
            ):
                log.warning("config reload (%s): discovery settings other than dns take effect after a restart", reason)
            self.discovery = self.discovery.model_copy(update={n: getattr(fresh.discovery, n) for n in live})
        self.workers = list(fresh.workers)
        log.info(
            "config reload (%s): %d configured workers, %d DNS names",
            reason,
            len(self.workers),
            len(self.discovery.dns),
        )
        await self.refresh()
        return True
