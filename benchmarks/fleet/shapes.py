"""The fleet shapes the matrix and the virtual fleet run: timing profiles, size, speed, KV capacity."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_FLEETS", "FLEETS", "Fleet"]


@dataclass(frozen=True)
class Fleet:
    """One cluster shape: timing profiles (cycled over the workers), speed-up, KV capacity."""

    name: str
    profile: str
    workers: int
    speedup: float
    capacity_tokens: int


FLEETS: dict[str, Fleet] = {
    f.name: f
    for f in (
        Fleet("4x8b-h100", "llama-3.1-8b-h100", 4, 0.25, 24576),
        Fleet("4x70b-tp4-h200", "llama-3.1-70b-tp4-h200", 4, 0.5, 24576),
        Fleet("2x8b-h100+2x8b-a100", "llama-3.1-8b-h100,llama-3.1-8b-a100", 4, 0.25, 24576),
        # The real-time confirmation at 8 workers (issue 22): the same GPUs, twice the fleet.
        Fleet("8x8b-h100", "llama-3.1-8b-h100", 8, 0.25, 24576),
        Fleet("4x8b-h100+4x8b-a100", "llama-3.1-8b-h100,llama-3.1-8b-a100", 8, 0.25, 24576),
    )
}
# What --matrix runs without --matrix-fleets: the 4-worker fleets (the 8-worker ones are asked for by name).
DEFAULT_FLEETS = ("4x8b-h100", "4x70b-tp4-h200", "2x8b-h100+2x8b-a100")
