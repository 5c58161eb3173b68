"""``torchpass chaos``: run the matrix, print the counts and every failure's replay command."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from torchpass_plugins.observe.provenance import code_fingerprint, disclose, recorded
from torchpass_plugins.testing.chaos.matrix import Result, run_matrix, summary

BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"


def run_chaos(seed: int, indices: Iterable[int], work_dir: str, doc: str | None, links: bool = False) -> int:
    indices = list(indices)
    t0 = time.monotonic()
    results = run_matrix(seed, indices, Path(work_dir), log=lambda line: print(line, flush=True), links=links)
    minutes = (time.monotonic() - t0) / 60
    table = summary(results, seed)
    print(f"\n{table}\n\n{minutes:.1f} min", flush=True)
    if doc is not None:
        _write(Path(doc), seed, results, table, minutes, links)
    return 1 if any(r.outcome == "failure" for r in results) else 0


def _write(doc: Path, seed: int, results: list[Result], table: str, minutes: float, links: bool) -> None:
    """Replace the seed's section of ``doc`` (between its chaos markers) with the newest result, and write
    every scenario's result beside it (``chaos/seed-S.jsonl``), so anyone can recount."""
    family = "links-seed" if links else "seed"
    begin, end = f"<!-- chaos:begin {family}={seed} -->", f"<!-- chaos:end {family}={seed} -->"
    raw = doc.parent / "chaos" / f"{family}-{seed}.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text("".join(json.dumps({"seed": seed, **asdict(r)}) + "\n" for r in results))
    block = (
        f"{begin}\n- Command: `torchpass chaos {'--links ' if links else ''}--seed {seed} --scenarios {len(results)} "
        f"--doc {doc}`\n"
        f"- Code: {recorded()}; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{minutes:.0f} minutes on this machine; every scenario's result: [{raw.name}](chaos/{raw.name})\n\n"
        f"{table}\n{end}"
    )
    text = doc.read_text() if doc.exists() else f"{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        sys.exit(f"torchpass chaos: {doc} has no {BEGIN} ... {END} section to write into")
    if begin not in text:  # a seed not run before: its section goes last
        text = text.replace(END, f"{begin}\n{end}\n{END}", 1)
    text = re.sub(f"{re.escape(begin)}.*?{re.escape(end)}", lambda _: block, text, flags=re.S)
    doc.write_text(disclose(text, code_fingerprint()))
