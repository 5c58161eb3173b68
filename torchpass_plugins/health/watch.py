"""Device health: readings from NVML (or an injected source), and the policy that turns them into actions.

The per-node agent runs the :class:`HealthWatch` (it outlives its workers). A :class:`HealthSource` reads
one :class:`DeviceHealth` per device; :class:`HealthThresholds` classifies a reading into findings, critical
or degraded, which the watch reports; the job's ``Policy`` decides what to do about them.
:class:`NvmlHealthSource` reads real GPUs through ``pynvml``; :class:`FileHealthSource` reads a JSON file
that tests and drills write (``{"1": {"temperature_c": 95}}`` is "GPU 1 is at 95 C"), so the whole path
runs on a machine without GPUs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

log = logging.getLogger(__name__)

Severity = Literal["degraded", "critical"]
_REPEAT_S = 60.0  # a degraded finding is reported again at most this often per device and check
# XIDs that mean the GPU itself is failing (NVIDIA's XID catalogue: double-bit ECC, fallen off the bus,
# row-remapping failure, uncontained ECC, GSP errors): a worker on it should move.
CRITICAL_XIDS = (48, 63, 64, 74, 79, 92, 94, 95, 119, 120)


class HealthUnavailable(RuntimeError):
    """The source cannot read anything on this machine (no NVML library, no driver)."""


@dataclass(frozen=True)
class DeviceHealth:
    """One reading of one device; ``None`` where the device or driver does not report the value."""

    device: int
    temperature_c: float | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    xids: tuple[int, ...] = ()  # XID events since the previous reading
    throttle_reasons: int | None = None  # NVML clocks-event bitmask
    sm_clock_mhz: int | None = None  # the SM clock now (under load: below its maximum when throttled)
    power_w: float | None = None
    recovery_action: int | None = None  # NVML's GPU recovery action (0: none needed)

    @classmethod
    def from_dict(cls, device: int, values: dict[str, Any]) -> DeviceHealth:
        known = {f.name for f in fields(cls)} - {"device"}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown health fields {sorted(unknown)}; known: {sorted(known)}")
        values = dict(values)
        if "xids" in values:
            values["xids"] = tuple(values["xids"])
        return cls(device=device, **values)


class HealthSource(ABC):
    @abstractmethod
    def read(self, devices: list[int]) -> list[DeviceHealth]:
        """A reading of each of ``devices`` (indices as the workers see them)."""

    def close(self) -> None:  # noqa: B027  (most sources hold nothing)
        """Release what the source holds."""


class FileHealthSource(HealthSource):
    """Readings from a JSON file ``{"<device>": {field: value}}``; devices not in it read as healthy."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self, devices: list[int]) -> list[DeviceHealth]:
        try:
            data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError) as exc:  # being rewritten: read it next time
            log.debug("torchpass: health file %s unreadable: %s", self.path, exc)
            data = {}
        return [DeviceHealth.from_dict(d, data.get(str(d), {})) for d in devices]


class NvmlHealthSource(HealthSource):
    """Reads GPUs through NVML. ``nvml`` is the ``pynvml`` module (a fake one in tests)."""

    def __init__(self, nvml: ModuleType | None = None) -> None:
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise HealthUnavailable(f"NVML is not available ({exc})") from exc
        self.count = nvml.nvmlDeviceGetCount()
        self._events = None
        try:
            self._events = nvml.nvmlEventSetCreate()
            for index in range(self.count):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        except nvml.NVMLError as exc:  # e.g. not supported on this GPU or driver: no XIDs, the rest works
            log.info("torchpass: NVML XID events unavailable (%s)", exc)

    def _value(self, fn, *args) -> Any:
        try:
            return fn(*args)
        except self.nvml.NVMLError:  # NotSupported, NoPermission, ...: this value is unknown
            return None

    def _xids(self) -> dict[int, list[int]]:
        found: dict[int, list[int]] = {}
        if self._events is None:
            return found
        nvml = self.nvml
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # NVMLError_Timeout: no more events
                return found
            index = self._value(nvml.nvmlDeviceGetIndex, data.device)
            if index is not None:
                found.setdefault(index, []).append(int(data.eventData))

    def read(self, devices: list[int]) -> list[DeviceHealth]:
        nvml, xids, out = self.nvml, self._xids(), []
        for device in devices:
            if device >= self.count:
                out.append(DeviceHealth(device))
                continue
            h = nvml.nvmlDeviceGetHandleByIndex(device)
            power = self._value(nvml.nvmlDeviceGetPowerUsage, h)
            pending_pages = self._value(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
            remap = self._value(nvml.nvmlDeviceGetRemappedRows, h)  # (corr, unc, pending, failure)
            out.append(DeviceHealth(
                device=device,
                temperature_c=self._value(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU),
                ecc_uncorrected_volatile=self._value(nvml.nvmlDeviceGetTotalEccErrors, h,
                                                     nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC),
                ecc_uncorrected_aggregate=self._value(nvml.nvmlDeviceGetTotalEccErrors, h,
                                                      nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                      nvml.NVML_AGGREGATE_ECC),
                retired_pages_pending=None if pending_pages is None else bool(pending_pages),
                remapped_rows_pending=None if remap is None else bool(remap[2]),
                xids=tuple(xids.get(device, ())),
                throttle_reasons=self._value(nvml.nvmlDeviceGetCurrentClocksEventReasons, h),
                sm_clock_mhz=self._value(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM),
                power_w=None if power is None else power / 1000.0,
                recovery_action=self._recovery_action(h),
            ))
        return out

    def _recovery_action(self, handle) -> int | None:
        """The driver's recommended recovery action, where this pynvml and driver offer it."""
        nvml = self.nvml
        if not hasattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"):
            return None
        values = self._value(nvml.nvmlDeviceGetFieldValues, handle, [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
        if not values or values[0].nvmlReturn != nvml.NVML_SUCCESS:
            return None
        return int(values[0].value.uiVal)

    def close(self) -> None:
        if self._events is not None:
            self._value(self.nvml.nvmlEventSetFree, self._events)
        self._value(self.nvml.nvmlShutdown)


@dataclass(frozen=True)
class Finding:
    """What a reading shows about one check of a device: ``critical`` (the device is failing or about to)
    or ``degraded`` (worth a look). What to do about it is ``Policy``'s decision."""

    severity: Severity
    check: str  # what was checked ("temperature", "xid", ...): warnings repeat once a minute per device and check
    why: str


@dataclass(frozen=True)
class HealthThresholds:
    """A reading past a ``*_migrate`` threshold is critical (the job moves the worker off the device); past
    a ``*_warn`` threshold it is degraded (logged). ``None`` turns a check off."""

    temperature_warn_c: float | None = 85.0
    temperature_migrate_c: float | None = 92.0
    ecc_uncorrected_migrate: int | None = 1  # volatile uncorrectable ECC errors since boot
    migrate_on_pending_retirement: bool = True  # retired pages or remapped rows waiting for a reset
    migrate_xids: tuple[int, ...] = CRITICAL_XIDS
    power_warn_w: float | None = None
    migrate_on_recovery_action: bool = True  # the driver asks for a reset or reboot

    def classify(self, h: DeviceHealth) -> list[Finding]:
        """The findings of a reading, each with the reason to log."""
        out: list[Finding] = []

        def over(value, limit) -> bool:
            return value is not None and limit is not None and value >= limit

        hot = f"GPU {h.device} at {h.temperature_c} C"
        if over(h.temperature_c, self.temperature_migrate_c):
            out.append(Finding("critical", "temperature", f"{hot} (migrate at {self.temperature_migrate_c} C)"))
        elif over(h.temperature_c, self.temperature_warn_c):
            out.append(Finding("degraded", "temperature", f"{hot} (warn at {self.temperature_warn_c} C)"))
        if over(h.ecc_uncorrected_volatile, self.ecc_uncorrected_migrate):
            out.append(Finding("critical", "ecc",
                               f"GPU {h.device}: {h.ecc_uncorrected_volatile} uncorrectable ECC error(s)"))
        if self.migrate_on_pending_retirement and (h.retired_pages_pending or h.remapped_rows_pending):
            out.append(Finding("critical", "retirement",
                               f"GPU {h.device}: memory page retirement / row remapping pending"))
        critical = [x for x in h.xids if x in self.migrate_xids]
        if critical:
            out.append(Finding("critical", "xid", f"GPU {h.device}: XID {', '.join(map(str, critical))}"))
        elif h.xids:
            out.append(Finding("degraded", "xid", f"GPU {h.device}: XID {', '.join(map(str, h.xids))}"))
        if over(h.power_w, self.power_warn_w):
            out.append(Finding("degraded", "power",
                               f"GPU {h.device} draws {h.power_w:g} W (warn at {self.power_warn_w:g})"))
        if self.migrate_on_recovery_action and h.recovery_action:
            out.append(Finding("critical", "recovery action",
                               f"GPU {h.device}: the driver asks for recovery action {h.recovery_action}"))
        return out


def is_source(source: str) -> bool:
    """Whether ``source`` names a health source: ``nvml``, ``file:PATH`` or ``off``."""
    return source in ("nvml", "off") or source.startswith("file:")


@dataclass
class HealthConfig:
    """``source``: ``nvml``, ``file:PATH`` (injected readings), or ``off``; built from the job's
    configuration (``HealthSettings``), which holds the defaults."""

    source: str
    interval_s: float
    thresholds: HealthThresholds = field(default_factory=HealthThresholds)

    def open(self) -> HealthSource | None:
        """The configured source, or None (with one log line saying why) when the watch is off."""
        if not is_source(self.source):
            raise ValueError(f"health source must be 'nvml', 'file:PATH' or 'off', not {self.source!r}")
        if self.source == "off":
            return None
        if self.source.startswith("file:"):
            return FileHealthSource(self.source[len("file:"):])
        try:
            return NvmlHealthSource()
        except (HealthUnavailable, ImportError) as exc:
            log.warning("torchpass: GPU health watch off: %s", exc)
            return None


class HealthWatch:
    """Reads the watched devices every interval and reports their findings: a detector only."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self._reported: dict[tuple[int, str], float] = {}  # (device, check) -> when its degraded finding was

    def run(self, devices: Callable[[], list[int]], report: Callable[[int, list[Finding]], None],
            done: threading.Event) -> None:
        """Until ``done``: read ``devices()`` and ``report(device, findings)`` where there are any."""
        source = self.config.open()
        if source is None:
            return
        try:
            while not done.wait(self.config.interval_s):
                for reading in source.read(devices()):
                    findings = [f for f in self.config.thresholds.classify(reading) if self._due(reading.device, f)]
                    if findings:
                        report(reading.device, findings)
        finally:
            source.close()

    def _due(self, device: int, finding: Finding) -> bool:
        """A critical finding always; a degraded one unless reported within the last minute."""
        if finding.severity == "critical":
            return True
        now = time.monotonic()
        if now - self._reported.get((device, finding.check), -1e9) <= _REPEAT_S:
            return False
        self._reported[(device, finding.check)] = now
        return True
