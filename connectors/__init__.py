"""L3 backends behind one async interface: file, redis, s3, and a registry that builds the configured one."""

from .base import BackendError, BackendMisconfigured, BackendUnavailable, Capabilities, Connector
from .registry import build

__all__ = ["BackendError", "BackendMisconfigured", "BackendUnavailable", "Capabilities", "Connector", "build"]
