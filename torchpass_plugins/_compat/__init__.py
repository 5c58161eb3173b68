"""Framework internals torchpass needs where the framework has no public route, in one place.

Each module names the versions it was checked against; ``tests/test_compat.py`` fails loudly when one of
these internals changes shape.
"""
