"""The interpreter's own exit steps, for a forked worker that must then leave with ``os._exit`` (checked
against CPython 3.11.7; ``tests/test_compat.py`` fails when they change).

A worker forked by the fork server shares its parent's imported modules, so it must not run the normal
interpreter teardown (which would tear those modules down); but what ``sys.exit`` does first, joining
non-daemon threads and running ``atexit`` handlers, must still happen. CPython has no public call for
either step.
"""

from __future__ import annotations

import atexit
import threading


def run_exit_steps() -> None:
    """Join the non-daemon threads, then run the ``atexit`` handlers, as the interpreter does at exit."""
    threading._shutdown()
    atexit._run_exitfuncs()
