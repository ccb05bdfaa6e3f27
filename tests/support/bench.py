"""What the benchmark tests share: the smallest gsp workload a suite can run end to end in seconds, fast."""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_GSP", "quick_run"]

# 2 groups x 3 prompts of a 256-token system prompt and a 16-token question, 4 output tokens: 6 requests.
TINY_GSP = [
    "--gsp-groups",
    "2",
    "--gsp-prompts-per-group",
    "3",
    "--gsp-system-len",
    "256",
    "--gsp-question-len",
    "16",
    "--output-len",
    "4",
]


def quick_run(out: Path, speedup: str) -> list[str]:
    """Simulated GPUs ``speedup`` times faster, small KV pools, the figures as JSON in ``out``, no progress bar."""
    return ["--speedup", speedup, "--capacity-tokens", "4096", "--json", str(out), "--no-progress"]
