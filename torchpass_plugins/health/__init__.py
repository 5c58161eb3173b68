"""Detectors: device health readings (NVML or an injected source) and straggler detection."""
