"""hicached configuration: the schema with its defaults, loading and validation of the TOML file."""

from .loader import ConfigError, from_dict, load, resolve_path, validate
from .schema import Config

__all__ = ["Config", "ConfigError", "from_dict", "load", "resolve_path", "validate"]
