"""``hydra/launcher=torchpass``: each job of a Hydra run or sweep trains under its own ``torchpass launch``.

A Hydra app then needs no code of its own to get spares: its task function builds the Trainer and trains.
For each job the launcher composes the job's config, checks its ``torchpass`` settings, and starts
``torchpass launch`` of the same app (the same config) with the job's overrides; in the workers that launch
starts, Hydra runs the task function in-process (``hydra.mode=RUN``) with the job's output directory as
their run directory, so the event log, the report and Hydra's own files land in one place. Jobs with
``torchpass.enabled=false`` run in this process, as Hydra's basic launcher runs them.

Hydra hands only sweeps (``-m``) to a launcher and runs a plain run's task function itself, so the same
config group also adds the callback :class:`TorchPassRun`, which does for a plain run what the launcher
does for each job of a sweep. The config is ``configs/hydra/launcher/torchpass.yaml`` (found through
torchpass's search-path plugin). Hydra's plugin scan executes this module again after any import of it,
so compare its classes through the module (``launcher.LaunchRefused``), not names imported earlier.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)

# Hydra settings the launcher decides for the workers it starts; the app's others reach them unchanged.
_DECIDED_FOR_WORKERS = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.output_subdir", "hydra.launcher",
                        "hydra/launcher", "hydra.sweeper", "hydra/sweeper")


class LaunchRefused(CompactHydraException):
    """A job that cannot start, or that ended in failure: Hydra prints the message alone."""


class TorchPassLauncher(Launcher):
    """Runs the jobs of a sweep one after another, each under its own ``torchpass launch`` (two at once
    would share this node's cores and devices). Every job's settings are checked before the first starts."""

    def __init__(self, active_ranks: Any = None, num_nodes: Any = 1) -> None:
        del active_ranks, num_nodes  # the config's keys; read from each job's config, as a sweep may change them
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.app: list[str] = []

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function
        self.app = app_command(sys.modules["__main__"], sys.argv[0])

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        jobs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            job_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job_config):
                job_config.hydra.job.id = job_config.hydra.job.num = idx
                # as run_job will set it, so that the settings can name it (``${hydra:runtime.output_dir}``)
                job_config.hydra.runtime.output_dir = os.path.abspath(
                    os.path.join(str(job_config.hydra.sweep.dir), str(job_config.hydra.sweep.subdir)))
            jobs.append((idx, overrides, job_config, job_settings(job_config)))
        HydraConfig.instance().set_config(self.config)
        returns = []
        for idx, overrides, job_config, (settings, processes) in jobs:
            log.info(f"#{idx} : {' '.join(filter_overrides(overrides))}")
            task = self.task_function if processes is None else functools.partial(
                _supervise, self.app, settings, processes, overrides)
            returns.append(run_job(hydra_context=self.hydra_context, task_function=task, config=job_config,
                                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir"))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return returns


class TorchPassRun(Callback):
    """A plain run (no ``-m``) with torchpass on: run it as the launcher runs one job of a sweep, in Hydra's
    run directory, and end the process with its outcome, so that Hydra does not also run the task function
    here. In the workers ``torchpass launch`` starts, and with torchpass off, it does nothing. Hydra turns
    a callback's exception into a warning and would then run the task function here, so every error ends
    the process (exit code 1) with its message."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from torchpass_plugins.config import in_torchpass_worker

        if in_torchpass_worker():
            return
        try:
            with open_dict(config):
                config.hydra.runtime.output_dir = os.path.abspath(str(config.hydra.run.dir))
            settings, processes = job_settings(config)
            if processes is None:
                return
            supervise = functools.partial(_supervise, app_command(sys.modules["__main__"], sys.argv[0]), settings,
                                          processes, list(config.hydra.overrides.task))
            job = run_job(hydra_context=HydraContext(config_loader=None, callbacks=_JobCallbacksInWorkers()),
                          task_function=supervise, config=config, job_dir_key="hydra.run.dir", job_subdir_key=None)
            _ = job.return_value  # raises LaunchRefused when the launch failed
        except Exception as exc:  # anything else would let Hydra train in this process
            sys.exit(str(exc) if isinstance(exc, LaunchRefused) else f"{type(exc).__name__}: {exc}")
        sys.exit(0)


class _JobCallbacksInWorkers:
    """For the job of a plain run started by :class:`TorchPassRun`: the app's callbacks hear of the job in
    the workers, where Hydra runs it (``on_job_start``, ``on_job_end``), not here as well."""

    def on_job_start(self, **kwargs: Any) -> None:
        pass

    def on_job_end(self, **kwargs: Any) -> None:
        pass


def job_settings(job_config: DictConfig) -> tuple[Any, int | None]:
    """The job's torchpass settings and how many processes its ``torchpass launch`` starts (``None``: torchpass
    is off, the job runs in-process). Raises ``LaunchRefused`` naming the setting to change. Leaves Hydra's
    current config set to the job's, which its settings may refer to."""
    from torchpass_plugins.config import TorchPassConfig, from_mapping
    from torchpass_plugins.errors import ConfigError

    if "torchpass" not in job_config:
        raise LaunchRefused("hydra/launcher=torchpass reads the job's `torchpass` settings: add `- torchpass: ddp` "
                            "(or fsdp, off) to the defaults list of the app's config")
    HydraConfig.instance().set_config(job_config)
    try:
        settings = from_mapping(OmegaConf.to_container(job_config.torchpass, resolve=True))
    except ConfigError as exc:
        raise LaunchRefused(str(exc)) from exc
    if not settings.enabled:
        return settings, None
    launcher = job_config.hydra.launcher
    if launcher.num_nodes != 1:
        raise LaunchRefused(
            f"hydra/launcher=torchpass starts the workers of one node, not num_nodes={launcher.num_nodes}: on "
            "several nodes, start `torchpass launch` on each (see examples/slurm)")
    if not isinstance(launcher.active_ranks, int) or launcher.active_ranks < 1:
        raise LaunchRefused(
            f"hydra/launcher=torchpass needs the job's active ranks as an integer, not {launcher.active_ranks!r}: "
            "set trainer.devices, or hydra.launcher.active_ranks for an app without a Lightning Trainer")
    output_dir = job_config.hydra.runtime.output_dir
    if settings.run_dir != TorchPassConfig().run_dir and os.path.abspath(settings.run_dir) != output_dir:
        raise LaunchRefused(
            f"torchpass.run_dir={settings.run_dir!r}: under hydra/launcher=torchpass the run directory is the "
            "job's output directory; remove torchpass.run_dir (or set hydra.sweep.dir / hydra.sweep.subdir)")
    return settings, launcher.active_ranks + settings.spares


def app_command(main: Any, argv0: str) -> list[str]:
    """How this app was started, for its workers: ``-m package.module`` when run as a module, its script
    otherwise."""
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        return ["-m", spec.name]
    return [str(Path(argv0).resolve())]


def config_arguments(hydra: DictConfig) -> list[str]:
    """The app's primary config, as given to this process (``--config-name``, ``--config-path``,
    ``--config-dir``), for the workers to compose the same one."""
    argv = [f"--config-name={hydra.job.config_name}"]
    for source in hydra.runtime.config_sources:
        if source.schema not in ("file", "pkg"):
            continue  # the ConfigStore's: every process registers its own
        where = source.path if source.schema == "file" else f"pkg://{source.path}"
        if source.provider == "main":
            argv.append(f"--config-path={where}")
        elif source.provider == "command-line":
            argv.append(f"--config-dir={where}")
    return argv


def launch_command(app: list[str], settings: Any, processes: int, run_dir: str, config: Sequence[str],
                   task_overrides: Sequence[str], hydra_overrides: Sequence[str]) -> list[str]:
    """``torchpass launch`` of the app for one job: its workers run the task function in-process
    (``hydra.mode=RUN``) with the job's output directory as their run directory, and write no second copy
    of Hydra's files there."""
    kept = [o for o in hydra_overrides if not o.lstrip("+~").startswith(_DECIDED_FOR_WORKERS)]
    return [sys.executable, "-m", "torchpass_plugins.cli", "launch", "--nproc-per-node", str(processes),
            *dataclasses.replace(settings, run_dir=run_dir).launch_argv(), "--", *app, *config, *task_overrides,
            *kept, "hydra.mode=RUN", f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"]


def _supervise(app: list[str], settings: Any, processes: int, overrides: Sequence[str], _cfg: DictConfig) -> None:
    """The task function of a job with torchpass on: run its ``torchpass launch`` from where the app was
    started, and wait for it. SIGINT and SIGTERM (Ctrl-C, a scheduler's stop) go to the launch, which stops
    its workers first; then they take their usual effect here, so they end a sweep, not only its job."""
    hydra = HydraConfig.get()
    run_dir = hydra.runtime.output_dir
    argv = launch_command(app, settings, processes, run_dir, config_arguments(hydra), overrides,
                          hydra.overrides.hydra)
    log.info(f"torchpass launch: {processes} processes ({settings.spares} spare), run directory {run_dir}")
    launch = subprocess.Popen(argv, cwd=hydra.runtime.cwd)
    received = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        launch.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = launch.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        signal.raise_signal(received[0])
    if code:
        job = OmegaConf.select(hydra, "job.num", default=None)
        raise LaunchRefused(f"{'' if job is None else f'job {job} '}({' '.join(overrides) or 'no overrides'}): "
                            f"torchpass launch exited with code {code}; its events and report are in {run_dir}")
