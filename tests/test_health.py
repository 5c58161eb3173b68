"""Health sources and policy (NVML against a fake pynvml, the real one absent here), and step timing."""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace

import pytest

from torchpass_plugins.health.stragglers import StepTimer, stragglers
from torchpass_plugins.health.watch import (
    DeviceHealth,
    FileHealthSource,
    Finding,
    HealthConfig,
    HealthThresholds,
    HealthUnavailable,
    HealthWatch,
    NvmlHealthSource,
)


class _FakeNvml:
    """Mimics the parts of ``pynvml`` the watch uses: functions, constants and the error classes."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_SUCCESS = 0
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 200
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: list[dict], library: bool = True) -> None:
        self.gpus, self.library, self.events, self.shut = gpus, library, [], False

    def nvmlInit(self):
        if not self.library:
            raise self.NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetIndex(self, handle):
        return handle

    def _get(self, handle, name):
        value = self.gpus[handle].get(name)
        if value is None:
            raise self.NVMLError_NotSupported("Not Supported")
        return value

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._get(h, "temp")

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self._get(h, "ecc_volatile" if counter == self.NVML_VOLATILE_ECC else "ecc_aggregate")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._get(h, "pages_pending")

    def nvmlDeviceGetRemappedRows(self, h):
        return self._get(h, "remap")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._get(h, "throttle")

    def nvmlDeviceGetClockInfo(self, h, clock):
        return self._get(h, "sm_clock")

    def nvmlDeviceGetPowerUsage(self, h):
        return self._get(h, "power_mw")

    def nvmlDeviceGetFieldValues(self, h, ids):
        action = self._get(h, "recovery")
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=action))]

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, h, kinds, event_set):
        pass

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        if not self.events:
            raise self.NVMLError_Timeout("Timeout")
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set):
        pass


def test_nvml_readings_with_unsupported_values_and_xid_events():
    nvml = _FakeNvml([
        {"temp": 61, "ecc_volatile": 0, "ecc_aggregate": 3, "pages_pending": 0, "remap": (0, 0, 0, 0),
         "throttle": 0, "power_mw": 250_000, "recovery": 0, "sm_clock": 1980},
        {"temp": 95},  # a GPU (or driver) that reports nothing but its temperature
    ])
    nvml.events = [SimpleNamespace(device=1, eventData=79)]
    source = NvmlHealthSource(nvml)
    gpu0, gpu1 = source.read([0, 1])
    assert (gpu0.temperature_c, gpu0.ecc_uncorrected_aggregate, gpu0.power_w, gpu0.recovery_action) == (61, 3, 250.0, 0)
    assert gpu0.remapped_rows_pending is False and gpu0.xids == () and gpu0.sm_clock_mhz == 1980
    assert gpu1 == DeviceHealth(1, temperature_c=95, xids=(79,))  # NotSupported reads as unknown
    thresholds = HealthThresholds()
    assert thresholds.classify(gpu0) == []
    findings = thresholds.classify(gpu1)
    assert [f.severity for f in findings] == ["critical", "critical"]
    assert "GPU 1 at 95 C" in findings[0].why and "XID 79" in findings[1].why
    assert source.read([1])[0].xids == ()  # an event is reported once
    source.close()
    assert nvml.shut


def test_no_nvml_library_is_one_clear_line_and_the_watch_is_off(caplog):
    with pytest.raises(HealthUnavailable, match="Library Not Found"):
        NvmlHealthSource(_FakeNvml([], library=False))
    with caplog.at_level(logging.WARNING, logger="torchpass_plugins.health.watch"):
        assert HealthConfig(source="nvml", interval_s=5.0).open() is None  # the real pynvml: this machine has no GPU
    [record] = caplog.records
    assert "GPU health watch off" in record.getMessage()


def test_injected_readings_and_the_policy_thresholds(tmp_path):
    path = tmp_path / "health.json"
    source = HealthConfig(source=f"file:{path}", interval_s=5.0).open()
    assert isinstance(source, FileHealthSource)
    assert source.read([0, 1]) == [DeviceHealth(0), DeviceHealth(1)]  # no file yet: healthy
    path.write_text(json.dumps({"1": {"temperature_c": 88, "ecc_uncorrected_volatile": 2}}))
    _, gpu1 = source.read([0, 1])
    assert HealthThresholds().classify(gpu1) == [
        Finding("degraded", "temperature", "GPU 1 at 88 C (warn at 85.0 C)"),
        Finding("critical", "ecc", "GPU 1: 2 uncorrectable ECC error(s)")]
    assert HealthThresholds(temperature_warn_c=None, ecc_uncorrected_migrate=None).classify(gpu1) == []
    path.write_text(json.dumps({"1": {"temprature_c": 99}}))
    with pytest.raises(ValueError, match="unknown health fields"):
        source.read([1])
    with pytest.raises(ValueError, match="'nvml', 'file:PATH' or 'off'"):
        HealthConfig(source="smi", interval_s=5.0).open()


def test_step_timer_subtracts_collective_waits_and_windows_align():
    timer = StepTimer(window=2)
    assert not timer.boundary(1, now=0.0, waited=0.0)  # the first boundary only starts the clock
    assert timer.boundary(2, now=1.0, waited=0.25)  # step 1: 0.75 s of own work; the window [0, 2) lacks step 0
    assert timer.median == 0.0
    timer.boundary(3, now=2.0, waited=0.5)
    assert timer.boundary(4, now=3.0, waited=0.5)
    assert timer.median == pytest.approx(0.875)  # steps 2 and 3: 0.75 and 1.0
    timer.discard()  # a recovery: the window says nothing
    timer.boundary(5, now=9.0, waited=0.5)
    assert timer.boundary(6, now=10.0, waited=0.5) and timer.median == 0.0


def test_stragglers_against_the_median():
    assert stragglers([0.1, 0.1, 0.32], factor=1.5) == [2]
    assert stragglers([0.1, 0.12, 0.13], factor=1.5) == []
    assert stragglers([0.1, 0.0, 0.5], factor=1.5) == []  # a rank without a complete window: no verdict


def test_the_watch_reports_critical_findings_every_reading_and_a_degraded_one_once_a_minute(tmp_path):
    path = tmp_path / "health.json"
    path.write_text(json.dumps({"0": {"temperature_c": 88}, "1": {"xids": [79]}, "2": {"temperature_c": 99}}))
    reports, done = [], threading.Event()

    def report(device: int, findings: list[Finding]) -> None:
        reports.append((device, [(f.severity, f.check) for f in findings]))
        if len(reports) == 5:
            done.set()

    watch = HealthWatch(HealthConfig(source=f"file:{path}", interval_s=0.01))
    watch.run(lambda: [0, 1], report, done)  # device 2 is not watched (its worker was moved off)
    assert reports == [(0, [("degraded", "temperature")])] + [(1, [("critical", "xid")])] * 4
    off = HealthWatch(HealthConfig(source="off", interval_s=5.0))
    off.run(lambda: [0], report, threading.Event())  # returns at once
