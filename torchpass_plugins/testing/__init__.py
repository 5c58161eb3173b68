"""Fault injection (``TORCHPASS_FAULTS``) and the chaos matrix: drills for users, the test suite's tools."""
