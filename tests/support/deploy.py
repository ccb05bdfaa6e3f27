"""Helpers the deployment tests share: the generated Envoy config, its validation, the GPU launch command."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["envoy_validate", "generated_envoy_config", "sglang_launch_argv"]


def sglang_launch_argv() -> list[str]:
    """What ``prefix-router sglang-launch`` prints for the model the deployments ship with."""
    import argparse

    launch = pytest.importorskip(
        "sglang_workers.real.launch_command", reason="sglang_workers.real.launch_command not available"
    )
    parser = argparse.ArgumentParser()
    launch.configure(parser)
    return launch.build_command(
        parser.parse_args(
            [
                "--python",
                "python3",
                "--model-path",
                "/models/Llama-3.1-8B-Instruct",
                "--served-model-name",
                "meta-llama/Llama-3.1-8B-Instruct",
            ]
        )
    )


def generated_envoy_config(path: Path) -> dict[str, Any]:
    """Check ``path`` equals the output of the ``prefix-router envoy-config`` command in its header;
    returns the generated bootstrap."""
    import argparse

    from prefix_router import envoy_config, envoy_config_command

    text = path.read_text()
    prefix = "#   prefix-router envoy-config"
    command = next(line for line in text.splitlines() if line.startswith(prefix))
    parser = argparse.ArgumentParser()
    envoy_config_command.configure(parser)
    expected = envoy_config.bootstrap(
        envoy_config_command.spec_from_args(parser.parse_args(shlex.split(command[len(prefix) :])))
    )
    assert yaml.safe_load(text) == yaml.safe_load(envoy_config.dump(expected)), (
        f"{path.relative_to(ROOT)} is stale: regenerate it with the command in its header"
    )
    return expected


def envoy_validate(envoy_bin: str, path: Path) -> None:
    result = subprocess.run(
        [envoy_bin, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
