"""``prefix-router sglang-launch`` prints the exact SGLang command line the router needs."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_cli


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("sglang-launch", *args, timeout=30)


def test_prints_launch_command_with_router_flags() -> None:
    done = _run(
        "--model-path",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--port",
        "30001",
        "--page-size",
        "16",
        "--kv-events-port",
        "5557",
        "--tp-size",
        "2",
        "--",
        "--context-length",
        "8192",
    )
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--model-path"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert flags["--port"] == "30001" and flags["--page-size"] == "16" and flags["--tp-size"] == "2"
    assert json.loads(flags["--kv-events-config"]) == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "",
        "replay_endpoint": "tcp://*:5558",
    }
    assert "--enable-metrics" in argv and "--enable-cache-report" in argv
    assert argv[-2:] == ["--context-length", "8192"]


def test_run_without_sglang_explains_how_to_install() -> None:
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here: --run would really launch a server")
    done = _run("--model-path", "m", "--run")
    assert done.returncode == 1
    assert "pip install -e '.[sglang]' in the prefix-router checkout" in done.stderr and "Traceback" not in done.stderr


def test_rejects_bad_page_size() -> None:
    done = _run("--model-path", "m", "--page-size", "0")
    assert done.returncode == 2 and "page-size" in done.stderr


def test_cpu_launch_command_uses_the_install_and_the_cpu_flags(tmp_path: Path) -> None:
    """--cpu takes the Python, the model and the environment from the `make sglang-cpu` install."""
    root = _fake_install(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefix_router",
            "sglang-launch",
            "--cpu",
            "--port",
            "31000",
            "--kv-events-host",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PREFIX_ROUTER_SGLANG_CPU": str(root)},
    )
    assert done.returncode == 0, done.stderr
    words = shlex.split(done.stdout)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-") and "/" not in w.split("=")[0])
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["LD_LIBRARY_PATH"] == str(root / "prefix-router" / "libcuda")
    argv = words[len(env) :]
    assert argv[0] == str(root / "bin" / "python") and argv[1:3] == ["-m", "sglang.launch_server"]
    flags = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--model-path"] == str(root / "prefix-router" / "tiny-llama")
    assert flags["--device"] == "cpu" and flags["--attention-backend"] == "torch_native"
    assert flags["--cuda-graph-backend-decode"] == "disabled" and "--sleep-on-idle" in argv
    # A concrete host: SGLang would connect its PUB socket there instead of binding it unless told to bind.
    events = json.loads(flags["--kv-events-config"])
    assert events["endpoint"] == "tcp://127.0.0.1:5557" and events["bind"] is True


def test_cpu_launch_without_the_install_names_make_sglang_cpu(tmp_path: Path) -> None:
    nowhere = {"PREFIX_ROUTER_SGLANG_CPU": str(tmp_path / "nothing")}
    done = run_cli("sglang-launch", "--cpu", timeout=30, env=nowhere)
    assert done.returncode == 1 and "make sglang-cpu" in done.stderr and "Traceback" not in done.stderr
    up = run_cli("up", "--engine", "sglang-cpu", "--workers", "2", timeout=30, env=nowhere)
    assert up.returncode == 1 and "make sglang-cpu" in up.stderr and "Traceback" not in up.stderr


def test_install_errors_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_workers.real import install as installer

    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(installer.shutil, "which", lambda name: None)
    with pytest.raises(installer.InstallError, match="apt-get install gcc"):
        installer.install(tmp_path / "venv", sys.executable)
    monkeypatch.setattr(installer.shutil, "which", lambda name: "/usr/bin/cc")
    monkeypatch.setattr(installer, "_free_gb", lambda path: 3.0)
    with pytest.raises(installer.InstallError, match=r"needs about 12 GB free .* 3\.0 GB are"):
        installer.install(tmp_path / "venv", sys.executable)
    assert installer.main(["--dir", str(tmp_path / "venv")]) == 1  # the same, as one line on stderr
    # A build step that fails names itself and shows the end of what it printed.
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error: no input files' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(installer.InstallError) as failed:
        installer.build_stub(installer.CpuInstall(tmp_path / "venv"), str(broken))
    assert "building the libcuda.so.1 stand-in failed" in str(failed.value) and "no input files" in str(failed.value)


# ``ldconfig -p`` as Debian prints it, on a machine with libc but without Mooncake's RDMA libraries.
LISTING_WITHOUT_RDMA = (
    "2 libs found in cache `/etc/ld.so.cache'\n"
    "\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6\n"
    "\tlibnl-3.so.200 (libc6,x86-64) => /lib/x86_64-linux-gnu/libnl-3.so.200\n"
)


def test_the_library_check_reads_ldconfig() -> None:
    from sglang_workers.real.installation import PD_DEBIAN_PACKAGES, ldconfig_listing, missing_pd_packages

    listing = ldconfig_listing()  # this machine's own
    if not listing:
        pytest.skip("no ldconfig here")
    assert "libc.so.6" in listing
    assert set(missing_pd_packages(listing)) <= set(PD_DEBIAN_PACKAGES)
    assert missing_pd_packages(LISTING_WITHOUT_RDMA) == ["libibverbs1", "libnl-route-3-200"]
    assert missing_pd_packages("") == []  # no listing: the import check of Mooncake's engine decides


def test_install_without_mooncakes_libraries_finishes_the_aggregated_install(tmp_path: Path) -> None:
    """Only PD pairs need libibverbs and libnl: without them (and without root) the install still completes,
    and says in one line what PD lacks, instead of failing after the 11 GB were installed."""
    from sglang_workers.real import install as installer
    from sglang_workers.real.installation import CpuInstall, find_install

    root = _fake_install(tmp_path / "venv")
    done, pd_missing = installer.install(root, sys.executable, apt=False, libraries=lambda: LISTING_WITHOUT_RDMA)
    assert done.root == root and find_install(root) is not None  # aggregated workers can run
    assert pd_missing is not None and "\n" not in pd_missing
    assert "apt-get install libibverbs1 libnl-route-3-200" in pd_missing and "make sglang-cpu" in pd_missing
    assert "pd" not in done.stamp()
    problems = CpuInstall(root).pd_problems(LISTING_WITHOUT_RDMA)  # what a PD worker's start then says
    assert problems and "apt-get install libibverbs1 libnl-route-3-200" in problems[0]


def _fake_install(root: Path) -> Path:
    """An install's layout with a current stamp (what find_install checks), without the 11 GB."""
    from sglang_workers.real.installation import SGLANG_CPU_VERSION, CpuInstall, model_digest, stub_digest

    install = CpuInstall(root)
    install.python.parent.mkdir(parents=True)
    install.python.write_text("")
    install.libcuda_dir.mkdir(parents=True)
    (install.libcuda_dir / "libcuda.so.1").write_text("")
    install.model_dir.mkdir(parents=True)
    (install.model_dir / "config.json").write_text("{}")
    install.stamp_path.write_text(
        json.dumps({"sglang": SGLANG_CPU_VERSION, "libcuda": stub_digest(), "model": model_digest()})
    )
    return root
