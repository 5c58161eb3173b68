"""The worker's side of joining a job started by ``torchpass launch`` (or its torchrun supervisor), shared
by the Lightning strategies and the Accelerate loop API, and free of either framework.

A worker joins on first use of :func:`current_runtime`; a spare blocks there until it is promoted.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from torchpass_plugins.control.membership import (
    CONFIG_ERROR_EXIT,
    REJECTED_EXIT,
    UNRECOVERABLE_EXIT,
    JobAborted,
    JoinRejected,
    Unrecoverable,
    WorkerEnv,
    abort_request_key,
)
from torchpass_plugins.core.runtime import Runtime
from torchpass_plugins.errors import ConfigError

_OTHER_LAUNCHERS = {
    "TORCHELASTIC_RUN_ID": "torchrun / accelerate launch",
    "LOCAL_RANK": "another launcher (torchrun, accelerate launch or Lightning's own)",
}
_RUNTIME: Runtime | None = None


class NotUnderTorchPass(RuntimeError):
    """The worker was not started by ``torchpass launch``."""


def current_runtime(timeout: timedelta = timedelta(minutes=5)) -> Runtime:
    """The process's runtime, joined on first use (a spare blocks here until promoted)."""
    global _RUNTIME
    if _RUNTIME is None:
        env = WorkerEnv.from_env()
        if env is None:
            found = next((name for var, name in _OTHER_LAUNCHERS.items() if var in os.environ), None)
            where = f"it was started by {found}" if found else "no torchpass agent started it"
            raise NotUnderTorchPass(
                f"torchpass strategies need workers started by `torchpass launch`, but {where}. "
                "Run: torchpass launch --nproc-per-node N --spares S your_script.py"
            )
        _exit_job_on_config_error()
        runtime = Runtime(env, timeout)
        runtime.join()
        _RUNTIME = runtime
    return _RUNTIME


def _exit_job_on_config_error() -> None:
    """A ``ConfigError`` that reaches the top of a worker exits with ``CONFIG_ERROR_EXIT``, which makes the
    agent stop the whole job with the message instead of handing the same mistake to a spare. An
    ``Unrecoverable`` state hands its message to the coordinator, which stops the job with it (or restarts
    it from its newest snapshot). A promoted spare whose error before its first completed step is the one
    its rank's previous spare had stops the job like a configuration error (a crash loop otherwise). A
    ``JobAborted`` leaves quietly: the agent prints the coordinator's message once for the whole job."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        sys.stderr = sys.__stderr__  # the last word goes to the log, even if a library left stderr redirected
        if issubclass(exc_type, JobAborted) and _RUNTIME is not None:
            _RUNTIME.before_abort_exit()
        if issubclass(exc_type, Unrecoverable) and _RUNTIME is not None:
            _RUNTIME.member.store.set(abort_request_key(_RUNTIME.env.worker_id), str(exc))
            os._exit(UNRECOVERABLE_EXIT)
        if issubclass(exc_type, JobAborted):
            os._exit(1)
        if _RUNTIME is not None and _RUNTIME.unproven_spare and not issubclass(exc_type, (ConfigError, JoinRejected)):
            error = f"{exc_type.__name__}: {exc}".splitlines()[0]
            if _RUNTIME.error_repeats(error):
                previous(exc_type, exc, tb)
                _RUNTIME.member.store.set(abort_request_key(_RUNTIME.env.worker_id), (
                    f"torchpass: two spares promoted to rank {_RUNTIME.rank} failed the same way before completing "
                    f"a step ({error}); every spare would, so the job stops (the traceback is in the log)"))
                os._exit(CONFIG_ERROR_EXIT)  # not restarted either: a restart would repeat it too
        if issubclass(exc_type, JoinRejected):
            print(exc, file=sys.stderr, flush=True)
            os._exit(REJECTED_EXIT)
        previous(exc_type, exc, tb)
        if issubclass(exc_type, ConfigError):
            sys.stderr.flush()
            os._exit(CONFIG_ERROR_EXIT)

    sys.excepthook = hook
