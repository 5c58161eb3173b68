"""The prepared GPU check keeps working where no GPU is: its job parts and the two-process group mechanics run on
CPU tensors over gloo."""

from __future__ import annotations

import subprocess
import sys

import pytest
from jobs import REPO

pytestmark = pytest.mark.timeout(400)


def test_the_gpu_check_runs_its_parts_on_cpu_tensors():
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--on-cpu"], cwd=REPO, capture_output=True,
                          text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split(" | ")[0]: line for line in done.stdout.splitlines() if line.startswith("| (")}
    assert "bit-exact on every rank; every step applied once: yes" in rows["| (a) 3 ranks + 1 spare, one GPU, gloo"]
    sharded = rows[next(k for k in rows if k.startswith("| (f) torchpass_fsdp"))]
    assert "bit-exact on every rank; every step applied once: yes" in sharded and "steps rolled back 0" in sharded
    assert int(sharded.split("logged steps replayed ")[1].split()[0]) > 0
    replays = [row for key, row in rows.items() if key.startswith("| (g) replay")]
    assert len(replays) == 3 and all("bit-exact with the live steps: yes" in row for row in replays)
    assert "bit-exact on every rank" in rows["| (b) 1 rank + 1 spare, NCCL"]
    assert "restarts from a snapshot: 1; every step applied: yes" in rows["| (b) 1 rank + 1 spare, NCCL"]
    assert "stall / write = " in rows[next(k for k in rows if k.startswith("| (d)"))]
    kill = rows["| (e) NCCL, 2 ranks + 1 spare: kill rank 0 in backward"]
    assert "bit-exact on every rank; every step applied once on every rank: yes" in kill and "restarts: 0" in kill
    abort = rows[next(k for k in rows if "abort with a collective stuck" in k)]
    assert "still pending: yes" in abort and "the next generation works: yes" in abort
    assert "received bit-exact: yes" in rows[next(k for k in rows if k.startswith("| (e) state to a spare"))]
