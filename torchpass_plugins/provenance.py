"""Which code produced a published figure: every generated result records the commit it ran on."""

from __future__ import annotations

import subprocess
from pathlib import Path


def commit() -> str:
    """The checked-out commit of this package, marked when the package had uncommitted changes ("unknown"
    outside a git checkout, e.g. an installed wheel)."""
    package = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return head + (" with uncommitted changes" if git("status", "--porcelain", "--", ".") else "")
