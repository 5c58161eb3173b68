"""What a ``Trainer`` built in a worker of ``torchpass launch`` is given: the strategy and the snapshots that
the launch asks for (``--protect``, ``--snapshot-dir``), so that a platform protects scripts it did not write.

The decision is taken from the Trainer's arguments alone, before Lightning sees them, so what cannot be
protected is refused before any training, in one line, and a Trainer that would run the job's ranks as
unrelated processes (Lightning's own strategy under a launcher that set no ``LOCAL_RANK``) is refused too,
instead of training N copies. :func:`decide` is pure; :func:`announce` says what each job got.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchpass_plugins.control.worker_env import WorkerEnv
from torchpass_plugins.errors import ConfigError

OURS = ("torchpass_ddp", "torchpass_fsdp")
# The strategies --protect replaces, by the name a Trainer asks for: Lightning's own multi-process ones, and
# "auto", which is DDP on several devices (the launch has decided how many ranks the job has).
REPLACED = {"ddp": "torchpass_ddp", "fsdp": "torchpass_fsdp", "auto": "torchpass_ddp"}
# What a job of one active rank may ask for unprotected ("auto" on several GPUs is refused by the guard on
# ``init_process_group``, which Lightning's DDP would then call).
SINGLE_PROCESS = ("auto", "single_device", "single_xla")


@dataclass
class Protection:
    """The Trainer's arguments as torchpass gives them, and what the job is told about it."""

    arguments: dict[str, Any]
    asked: str  # the strategy the script asked for, as written
    strategy: str  # the one it runs on
    replaced: bool  # by --protect
    snapshots: tuple[str, int] | None  # (where, every N steps) of the snapshots it writes, if any
    notes: list[str] = field(default_factory=list)

    def line(self, spares: int, borrow: bool = False) -> str:
        """The level of protection the job got, and why, in one line."""
        live = (f"a lost worker is replaced live by one of {spares} spare(s)" if spares else
                "no spare (--spares 0): a lost worker restarts the job")
        if borrow:
            live += ", unless a device borrowed from a lending job (--borrow) takes its rank"
        if self.snapshots is not None:
            where, every = self.snapshots
            saved = (f"snapshots every {every} step(s) to {where}, resumed from after a restart" if every else
                     f"resumes from the newest snapshot in {where} (none written: --snapshot-every 0)")
        else:
            saved = "no snapshots (pass --snapshot-dir): a restart begins again from step 0"
        asked = f"Trainer(strategy={self.asked})" + (f" runs on {self.strategy}" if self.replaced else "")
        return "; ".join([f"torchpass: {asked}: {live}", saved, *self.notes])


def _named(strategy: Any) -> str | None:
    """The registry name a strategy was asked for by, or the name of an object's class in Lightning's
    registry (its first: ``DDPStrategy`` is "ddp"), or its ``strategy_name`` (torchpass's); None if none."""
    if isinstance(strategy, str):
        return strategy
    from lightning.pytorch.strategies import StrategyRegistry

    registered = (name for name, entry in StrategyRegistry.items() if entry["strategy"] is type(strategy))
    return getattr(strategy, "strategy_name", None) or next(registered, None)


def decide(arguments: dict[str, Any], env: WorkerEnv, callback_class: type) -> Protection | None:
    """The Trainer's ``arguments`` under this launch (None: unchanged, nothing to say). ``callback_class``:
    ``TorchPassCallback``, added (or completed) with the launch's snapshots. Raises ``ConfigError`` for a
    Trainer that cannot be protected as asked."""
    asked = arguments.get("strategy", "auto")
    written = repr(asked) if isinstance(asked, str) else f"{type(asked).__name__}(...)"
    name = _named(asked)
    if name in OURS:
        strategy = asked
    elif env.protect and isinstance(asked, str) and asked in REPLACED:
        strategy = REPLACED[asked]
    elif env.protect:
        how = ("it replaces the strategies asked for by name ('ddp', 'fsdp', 'auto'), whose options are all its own; "
               "pass the name, or torchpass's own object (TorchPassDDPStrategy, TorchPassFSDPStrategy)"
               if name in REPLACED else "only 'ddp', 'fsdp' and 'auto' have a torchpass counterpart")
        raise ConfigError(f"torchpass --protect: Trainer(strategy={written}) cannot be protected: {how}. Nothing "
                          "was trained; launch this script without --protect to run it as it is")
    elif env.snapshot_dir:
        raise ConfigError(f"torchpass launch --snapshot-dir: Trainer(strategy={written}) is not a torchpass strategy, "
                          "so its ranks cannot write the job's snapshots; add --protect (it replaces 'ddp', 'fsdp' "
                          "and 'auto') or use strategy='torchpass_ddp'")
    elif env.world_size > 1 or name not in SINGLE_PROCESS:
        raise ConfigError(f"torchpass launch started {env.world_size} active rank(s), but Trainer(strategy={written}) "
                          "does not take them (each would train alone, or start processes of its own): use "
                          "strategy='torchpass_ddp' or 'torchpass_fsdp', or launch with --protect to have it replaced")
    else:
        return None  # one process and a one-device strategy: it runs as it is, as under a plain launch
    if not (env.protect or env.snapshot_dir):
        return None
    protection = Protection(dict(arguments, strategy=strategy), written, _named(strategy), strategy != asked, None)
    _give_snapshots(protection, env, callback_class)
    return protection


def _give_snapshots(protection: Protection, env: WorkerEnv, callback_class: type) -> None:
    """The launch's snapshots for a Trainer whose script asked for none; a script's own stand."""
    given = protection.arguments.get("callbacks")
    callbacks = [] if given is None else list(given) if isinstance(given, Sequence) else [given]  # (ListConfig)
    own = next((c for c in callbacks if isinstance(c, callback_class)), None)
    if own is not None and own.snapshot_dir:
        protection.snapshots = (own.snapshot_dir, own.snapshot_every_n_steps)
        if env.snapshot_dir and own.snapshot_dir != env.snapshot_dir:
            protection.notes.append(f"the script's own snapshots stand, not --snapshot-dir {env.snapshot_dir}")
        return
    if not env.snapshot_dir:
        return
    if own is None:
        callbacks.append(callback_class(snapshot_dir=env.snapshot_dir, snapshot_every_n_steps=env.snapshot_every))
    else:  # the script's callback (weights published, a run directory) takes the launch's snapshots too
        own.snapshot_dir, own.snapshot_every_n_steps = env.snapshot_dir, env.snapshot_every
    protection.arguments["callbacks"] = callbacks
    protection.snapshots = (env.snapshot_dir, env.snapshot_every)


def rewrite(env: WorkerEnv, arguments: dict[str, Any]) -> tuple[dict[str, Any], Callable[[Any], None]]:
    """The Trainer's arguments under this launch, and what to do once it is built (see
    ``rewrite_trainer_arguments``)."""
    from torchpass_plugins.integrations.lightning.callback import TorchPassCallback

    protection = decide(arguments, env, TorchPassCallback)
    if protection is None:
        return arguments, lambda trainer: None
    return protection.arguments, lambda trainer: announce(protection)


def announce(protection: Protection) -> None:
    """Logical rank 0 of the job's start says what protection the job got (a spare entering later does not
    repeat it) and logs it in the event log."""
    from torchpass_plugins.control.worker import current_runtime
    from torchpass_plugins.core.interfaces import Phase

    runtime = current_runtime()  # joined as the Trainer built its torchpass strategy
    if runtime.rank != 0 or runtime.phase is not Phase.ACTIVE:
        return
    print(protection.line(runtime.env.spares, runtime.env.borrow), flush=True)
    where, every = protection.snapshots or ("", 0)
    runtime.events.emit("protection", rank=0, asked=protection.asked, strategy=protection.strategy,
                        spares=runtime.env.spares, snapshot_dir=where, snapshot_every=every)
