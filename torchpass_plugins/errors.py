"""Errors every layer raises; free of heavy imports, so configuration code can use them cheaply (the
Hydra search-path plugin loads the config schema in every Hydra app)."""


def with_prefix(message: str) -> str:
    """``message`` as torchpass prints it: with the ``torchpass`` prefix once, whether or not it had one."""
    return message if message.startswith("torchpass") else f"torchpass: {message}"


class ConfigError(ValueError):
    """A setting that no spare can fix: the whole job stops at once with this message."""
