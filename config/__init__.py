"""hicached configuration: the schema with its defaults, loading and validation of the TOML file."""

from .loader import ConfigError, check_backend, from_dict, load, resolve_path, socket_path, validate
from .schema import Config

__all__ = [
    "Config",
    "ConfigError",
    "check_backend",
    "from_dict",
    "load",
    "resolve_path",
    "socket_path",
    "validate",
]
