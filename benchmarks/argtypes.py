"""Argument types every suite's flags share, so that a bad value gets the same clear message everywhere.

Each is an ``argparse`` ``type=``: it turns the text into the value or raises ``ArgumentTypeError``,
which argparse prints as a usage error (exit status 2) naming the flag, never a stack trace.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import yaml

__all__ = ["integers", "key_value", "names", "positive", "positive_list", "profiles"]


def positive(kind: type) -> Callable[[str], Any]:
    """A positive ``kind`` (int or float)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def positive_list(kind: type) -> Callable[[str], list[Any]]:
    """``1,2,4`` -> a list of positive ``kind`` (int or float), at least one."""

    def parse(text: str) -> list[Any]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            what = "integers" if kind is int else "numbers"
            raise argparse.ArgumentTypeError(f"wants comma-separated {what}, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError("wants positive numbers")
        return values

    return parse


def integers(text: str) -> list[int]:
    """``0,1,2`` -> a list of integers (seeds), at least one."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("wants at least one integer")
    return values


def names(allowed: Sequence[str] | None = None) -> Callable[[str], tuple[str, ...]]:
    """``a,b`` -> a tuple of names, at least one, each of ``allowed`` when given."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(v.strip() for v in text.split(",") if v.strip())
        unknown = [v for v in items if allowed is not None and v not in allowed]
        if not items or unknown:
            choices = f" of {', '.join(allowed)}" if allowed else ""
            raise argparse.ArgumentTypeError(f"expected a comma-separated list{choices}, got {text!r}")
        return items

    return parse


def key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(key, value)``, the value read as YAML (``0.5`` a float, ``true`` a bool)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"want KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def profiles(text: str) -> str:
    """A timing profile or a comma-separated list of them, checked against the simulator's."""
    from sglang_workers.sim.timing import profile_list

    try:
        return ",".join(profile_list(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
