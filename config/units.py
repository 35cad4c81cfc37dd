"""Parsing of sizes ("4GiB") and durations ("500ms") used throughout the configuration."""

from __future__ import annotations

import math
import re

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

MILLISECONDS = 0.001
SECONDS = 1.0
MINUTES = 60.0

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
_DURATION_UNITS = {
    "us": 1e-6,
    "ms": MILLISECONDS,
    "s": SECONDS,
    "": SECONDS,
    "m": MINUTES,
    "min": MINUTES,
    "h": 3600.0,
}
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "512MiB", "4GiB", "100kB"."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 512MiB, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as 512MiB, got {value!r}")
    m = _NUMBER.match(value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 512MiB or 4GiB, got {value!r}")
    number, factor = m.group(1), _SIZE_UNITS[m.group(2).lower()]
    return int(number) * factor if "." not in number else int(float(number) * factor)


def parse_duration(value: int | float | str) -> float:
    """Seconds from a number (seconds) or a string such as "500ms", "5s", "2m"."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 500ms, got a boolean")
    if isinstance(value, int | float):
        if not math.isfinite(value):  # TOML's nan and inf: a time-out that never ends, or never starts
            raise ValueError(f"expected a finite duration such as 500ms or 5s, got {value}")
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration such as 500ms or 5s, got {value!r}")
    m = _NUMBER.match(value)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"expected a duration such as 500ms or 5s, got {value!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def format_size(n: int) -> str:
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= factor:
            return f"{n / factor:.1f}{unit}"
    return f"{n}B"


def exact_size(n: int) -> str:
    """`n` as a size the loader reads back to the same bytes, in the largest unit that divides it."""
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def exact_duration(s: float) -> str:
    """`s` seconds as a duration the loader reads back, in ms below a second."""
    if s == 0:
        return "0"
    if s < 1 and round(s * 1000, 6).is_integer():
        return f"{round(s * 1000)}ms"
    return f"{s:g}s"
