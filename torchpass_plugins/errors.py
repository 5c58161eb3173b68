"""Errors every layer raises; free of heavy imports, so configuration code can use them cheaply (the
Hydra search-path plugin loads the config schema in every Hydra app)."""


class ConfigError(ValueError):
    """A setting that no spare can fix: the whole job stops at once with this message."""
