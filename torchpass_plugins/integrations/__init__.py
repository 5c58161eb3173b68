"""Adapters between the engine and the training frameworks: Lightning strategies and callback, the
Accelerate loop."""
