"""A self-signed certificate for the TLS tests, made by the ``openssl`` CLI."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A P-256 certificate for the DNS name ``name``, its own CA, valid for a day: (cert.pem, key.pem) in
    ``directory``. Skips the test when the ``openssl`` CLI cannot make one."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        run = subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
            + ["-keyout", str(key), "-out", str(cert), "-days", "1"]
            + ["-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}"],
            capture_output=True,
        )
    except FileNotFoundError:
        pytest.skip("the openssl CLI is not installed")
    if run.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {run.stderr.decode()[-200:]}")
    return cert, key
