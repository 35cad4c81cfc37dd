"""The error of a configuration that cannot be used."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot be used; `path` names the offending key (e.g. "pool.capacity")."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)
