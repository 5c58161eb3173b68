"""``torchpass chaos``: run the matrix, print the counts and every failure's replay command."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from torchpass_plugins.chaos.matrix import run_matrix, summary

BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"


def run_chaos(seed: int, indices: Iterable[int], work_dir: str, doc: str | None) -> int:
    indices = list(indices)
    t0 = time.monotonic()
    results = run_matrix(seed, indices, Path(work_dir), log=lambda line: print(line, flush=True))
    minutes = (time.monotonic() - t0) / 60
    table = summary(results, seed)
    print(f"\n{table}\n\n{minutes:.1f} min", flush=True)
    if doc is not None:
        _write(Path(doc), seed, len(indices), table, minutes)
    return 1 if any(r.outcome == "failure" for r in results) else 0


def _write(doc: Path, seed: int, count: int, table: str, minutes: float) -> None:
    """Replace the text between the chaos markers of ``doc`` with the newest result."""
    block = (
        f"{BEGIN}\n- Command: `torchpass chaos --seed {seed} --scenarios {count} --doc {doc}`\n"
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {minutes:.0f} minutes on this machine\n\n"
        f"{table}\n{END}"
    )
    text = doc.read_text() if doc.exists() else f"{BEGIN}\n{END}\n"
    if BEGIN not in text:
        sys.exit(f"torchpass chaos: {doc} has no {BEGIN} ... {END} section to write into")
    doc.write_text(re.sub(f"{re.escape(BEGIN)}.*?{re.escape(END)}", lambda _: block, text, flags=re.S))
