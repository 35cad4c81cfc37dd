"""Errors with the stable codes that travel in answers (DESIGN.md: Conventions)."""

from __future__ import annotations

BAD_REQUEST = "bad_request"
NOT_FOUND = "not_found"
NO_SPACE = "no_space"
UNAUTHORIZED = "unauthorized"
BACKEND_UNAVAILABLE = "backend_unavailable"
BACKEND_MISCONFIGURED = "backend_misconfigured"
TIMEOUT = "timeout"
DRAINING = "draining"
BUSY = "busy"
INTERNAL = "internal"
CONNECTION = "connection"  # client side only: the daemon went away or the connection broke
# Copying pages between an engine's region and L2 failed; nothing was stored. When the region's memory
# shrank under the daemon, the message says so and the region is dropped (its handle: not_found).
COPY_FAILED = "copy_failed"
UNSUPPORTED = "unsupported"  # the daemon cannot do this here (a CUDA region on a daemon without CUDA)

CODES = frozenset(
    {
        BAD_REQUEST,
        NOT_FOUND,
        NO_SPACE,
        UNAUTHORIZED,
        BACKEND_UNAVAILABLE,
        BACKEND_MISCONFIGURED,
        TIMEOUT,
        DRAINING,
        BUSY,
        INTERNAL,
        CONNECTION,
        COPY_FAILED,
        UNSUPPORTED,
    }
)


class HicachedError(Exception):
    """An error with a stable `code` and a message a person can act on."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"[{code}] {message}")


def bad_request(message: str) -> HicachedError:
    return HicachedError(BAD_REQUEST, message)
