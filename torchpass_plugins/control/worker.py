"""The worker's side of joining a job started by ``torchpass launch`` (or its torchrun supervisor), shared
by the Lightning strategies and the Accelerate loop API, and free of either framework.

A worker joins on first use of :func:`current_runtime`; a spare blocks there until it is promoted.
"""

from __future__ import annotations

import atexit
import functools
import os
import runpy
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from torchpass_plugins.config import TimeoutConfig
from torchpass_plugins.control.membership import JobAborted, JoinRejected, Unrecoverable
from torchpass_plugins.control.protocol import ExitCode, abort_request_key, spare_error_key
from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.core.runtime import Runtime, SpareReleased
from torchpass_plugins.core.step_signals import Drained
from torchpass_plugins.errors import ConfigError
from torchpass_plugins.testing import faults

_OTHER_LAUNCHERS = {
    "TORCHELASTIC_RUN_ID": "torchrun / accelerate launch",
    "LOCAL_RANK": "another launcher (torchrun, accelerate launch or Lightning's own)",
}
_RUNTIME: Runtime | None = None
_exit_code = 0  # the worker's, once its script has ended (see run_as_worker)
_TIMEOUT: tuple[timedelta, bool] | None = None  # the runtime's collective timeout; whether it was the default
_AT_SCRIPT_END: list[Callable[[], None]] = []  # run once the script returned (a loop torchpass saw ends there)


class NotUnderTorchPass(RuntimeError):
    """The worker was not started by ``torchpass launch``."""


def current_runtime(timeout: timedelta | float | None = None) -> Runtime:
    """The process's runtime, joined on first use (a spare blocks here until promoted). ``timeout``: its
    collective timeout, a ``timedelta`` or seconds (None: ``torchpass.timeouts.collective_s``). There is one
    runtime per process, so a later caller naming another timeout than the one it was created with is a
    ``ConfigError`` rather than silently ignored."""
    global _RUNTIME, _TIMEOUT
    asked = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
    if _RUNTIME is not None:
        if asked is not None and asked != _TIMEOUT[0]:
            raise ConfigError(_conflicting_timeouts(*_TIMEOUT, asked))
        return _RUNTIME
    env = WorkerEnv.from_env()
    if env is None:
        found = next((name for var, name in _OTHER_LAUNCHERS.items() if var in os.environ), None)
        where = f"it was started by {found}" if found else "no torchpass agent started it"
        raise NotUnderTorchPass(
            f"torchpass strategies need workers started by `torchpass launch`, but {where}. "
            "Run: torchpass launch --nproc-per-node N --spares S your_script.py"
        )
    _TIMEOUT = (asked, False) if asked is not None else (timedelta(seconds=TimeoutConfig.collective_s), True)
    runtime = Runtime(env, _TIMEOUT[0])
    runtime.join()
    _RUNTIME = runtime
    return runtime


def _conflicting_timeouts(have: timedelta, defaulted: bool, asked: timedelta) -> str:
    origin = "the default, torchpass.timeouts.collective_s" if defaulted else "the timeout= given first"
    return (f"torchpass: this process's runtime uses a collective timeout of {have.total_seconds():g} s ({origin}), "
            f"but a later TorchPass strategy, TorchPassEnvironment or TorchPass asks for {asked.total_seconds():g} s; "
            "there is one runtime per process: give each of them the same timeout= (or none, and set "
            "torchpass.timeouts.collective_s)")


def run_as_worker(argv: list[str]) -> int:
    """The entry of every worker that ``torchpass launch`` starts (forked by its fork server, or a fresh
    interpreter when nothing is preloaded): run ``argv`` (``script.py args`` or ``-m module args``) as
    ``__main__``, as ``python argv...`` would, and return its exit code.

    Here, in a process torchpass started, and nowhere else (not on importing the package, not on building
    a strategy), torchpass takes the process-wide steps a worker needs: it registers the Lightning
    strategy names before the script runs and makes their ``devices="auto"`` the job's active ranks, an
    exception that escapes the script leaves through :func:`_leave_on_uncaught` (whose exit code tells the
    agent what to do), and :func:`_close_at_exit` runs at exit."""
    global _exit_code
    from torchpass_plugins import _STRATEGIES, register_strategies
    from torchpass_plugins._compat.lightning_trainer import (
        resolve_auto_devices_to_active_ranks,
        rewrite_trainer_arguments,
    )
    env = WorkerEnv.from_env()
    register_strategies()
    resolve_auto_devices_to_active_ranks(env.world_size, tuple(_STRATEGIES))
    rewrite_trainer_arguments(functools.partial(_protected, env))
    _refuse_loops_it_cannot_see(env)
    atexit.register(_close_at_exit)
    ended = True  # the script ended (returned or exited), not a worker leaving the job mid-training
    try:
        faults.load()  # a malformed TORCHPASS_FAULTS stops the job here, before training
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
        _exit_code = 0
    except SystemExit as exc:
        _exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        ended = not isinstance(exc, Drained | SpareReleased)  # (leaving the job mid-training: no loop ended)
        caught = exc.__context__  # what the script's framework caught, printed and exited on (Hydra's main)
        if _exit_code and isinstance(caught, Exception):
            _leave_on_uncaught(type(caught), caught, caught.__traceback__)
        elif not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        _exit_code = 1
        _leave_on_uncaught(*sys.exc_info())
    try:
        for finish in _AT_SCRIPT_END if _exit_code == 0 and ended else ():  # (also after sys.exit(0))
            finish()
    except BaseException:
        _exit_code = 1
        _leave_on_uncaught(*sys.exc_info())
    return _exit_code


def _protected(env: WorkerEnv, arguments: dict) -> tuple[dict, Any]:
    """A Trainer's arguments under this launch (imported when a Trainer is built: a worker whose script uses
    Accelerate does not load the Lightning strategies)."""
    from torchpass_plugins.integrations.lightning.protection import rewrite

    return rewrite(env, arguments)


def _refuse_loops_it_cannot_see(env: WorkerEnv) -> None:
    """A loop torchpass does not see would run the job's ranks as unrelated processes (no launcher variable
    tells them their rank) and a lost worker could not be replaced: an ``Accelerator`` built before any
    ``TorchPass()``, and a ``torch.distributed`` process group the script starts itself, are refused with what
    to change, before anything trains."""
    import torch.distributed as dist

    from torchpass_plugins._compat.accelerate import before_accelerator

    protect = (" --protect protects Lightning Trainers and Accelerate loops with no code change; it cannot see "
               "inside another hand-written loop." if env.protect else "")

    def joined_before_accelerator() -> None:
        if _RUNTIME is None and env.protect:  # snapshots and resume, without the loop's four lines
            from torchpass_plugins.integrations.accelerate.implicit import protect as protect_loop

            protect_loop(_AT_SCRIPT_END)
        elif _RUNTIME is None:
            raise ConfigError(
                "torchpass: `torchpass launch` started this process, but its Accelerator is built before any "
                "TorchPass(), so it does not join the job: its ranks would train as unrelated processes. Add "
                "`tp = TorchPass()` before Accelerator(), then tp.track(...), tp.epochs(...) and tp.batches(...) "
                "(the four lines of the Accelerate guide)." + protect)

    init = dist.init_process_group

    @functools.wraps(init)
    def init_process_group(backend: str | None = None, *args, **kwargs):
        from torchpass_plugins.core.default_group import BACKEND

        if backend != BACKEND:
            raise ConfigError(
                f"torchpass: this process starts a process group of its own (init_process_group(backend={backend!r}), "
                "from the script's loop or a strategy of Lightning's own), which torchpass cannot see: its ranks "
                "would not be the job's and a lost worker could not be replaced. Train with Lightning "
                "(strategy='torchpass_ddp' or 'torchpass_fsdp') or with Accelerate and TorchPass()." + protect)
        return init(backend, *args, **kwargs)

    before_accelerator(joined_before_accelerator)
    dist.init_process_group = init_process_group


def _close_at_exit() -> None:
    """At exit (an ``atexit`` handler, so after the non-daemon threads were joined): close the runtime while
    the interpreter is still whole, since gloo worker threads that outlive it abort the process
    (pytorch/pytorch#190489). When an operation of a replaced group is still stuck in C++ the groups cannot
    be closed, and the worker leaves at once with its exit code (``os._exit``)."""
    if _RUNTIME is not None and not _RUNTIME.close():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_code)


def _leave_on_uncaught(exc_type, exc, tb) -> None:
    """An exception escaped the worker's script, or the script's framework caught it and exited non-zero
    while handling it (Hydra's ``@hydra.main`` does), which must end the same way. A ``ConfigError`` exits
    with ``ExitCode.CONFIG_ERROR``, which makes the agent stop the whole job with the message instead of
    handing the same mistake to a spare. An ``Unrecoverable`` state hands its message to the coordinator,
    which stops the job with it (or restarts it from its newest snapshot). A promoted spare whose error
    before its first completed step is the one its rank's previous spare had stops the job like a
    configuration error (a crash loop otherwise). A ``JobAborted`` leaves quietly: the agent prints the
    coordinator's message once for the whole job. Any other error is printed by ``sys.excepthook`` (the
    interpreter's, or the script's own) and the worker exits with 1."""
    sys.stderr = sys.__stderr__  # the last word goes to the log, even if a library left stderr redirected
    if issubclass(exc_type, JobAborted) and _RUNTIME is not None:
        _RUNTIME.before_abort_exit()
    if issubclass(exc_type, Unrecoverable) and _RUNTIME is not None:
        _RUNTIME.member.store.set(abort_request_key(_RUNTIME.env.worker_id), str(exc))
        os._exit(ExitCode.UNRECOVERABLE)
    if issubclass(exc_type, JobAborted):
        os._exit(1)
    if _RUNTIME is not None and _RUNTIME.unproven_spare and not issubclass(exc_type, (ConfigError, JoinRejected)):
        error = f"{exc_type.__name__}: {exc}".splitlines()[0]
        if _error_repeats(_RUNTIME, error):
            sys.excepthook(exc_type, exc, tb)
            _RUNTIME.member.store.set(abort_request_key(_RUNTIME.env.worker_id), (
                f"torchpass: two spares promoted to rank {_RUNTIME.rank} failed the same way before completing "
                f"a step ({error}); every spare would, so the job stops (the traceback is in the log)"))
            os._exit(ExitCode.CONFIG_ERROR)  # not restarted either: a restart would repeat it too
    if issubclass(exc_type, JoinRejected):
        print(exc, file=sys.stderr, flush=True)
        os._exit(ExitCode.REJECTED)
    sys.excepthook(exc_type, exc, tb)
    if issubclass(exc_type, ConfigError):
        sys.stderr.flush()
        os._exit(ExitCode.CONFIG_ERROR)


def _error_repeats(runtime: Runtime, error: str) -> bool:
    """An unproven spare failed with ``error``: True when this rank's previous spare failed the same way
    (every spare would: the job must stop), else it is noted for the next one."""
    key, store = spare_error_key(runtime.rank), runtime.member.store
    if store.check([key]) and store.get(key).decode() == error:
        return True
    store.set(key, error)
    return False
