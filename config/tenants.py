"""[tenants.NAME]: the checks of the tenant tables, and the namespace patterns they list (exact names, or
prefixes ending in '*'), shared by the loader and the daemon's tenant table."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from .errors import ConfigError
from .schema import MAX_TENANTS, Config
from .units import exact_size

DEFAULT = "default"  # the tenant of admitted peers that match no [tenants.NAME]
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The namespace rule of hicached.common.keys (this layer imports nothing above it; tests/config checks that
# the two agree): a pattern is a namespace, or the start of one followed by '*'.
NAMESPACE_MAX_LEN = 128
_EXACT_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{NAMESPACE_MAX_LEN}}}")
_PREFIX_RE = re.compile(rf"[A-Za-z0-9._-]{{0,{NAMESPACE_MAX_LEN - 1}}}\*")


def valid_pattern(pattern: object) -> bool:
    if not isinstance(pattern, str) or pattern in (".", ".."):
        return False
    return bool(_EXACT_RE.fullmatch(pattern) or _PREFIX_RE.fullmatch(pattern))


def matches(pattern: str, namespace: str) -> bool:
    if pattern.endswith("*"):
        return namespace.startswith(pattern[:-1])
    return namespace == pattern


def matches_any(patterns: Iterable[str], namespace: str) -> bool:
    return any(matches(p, namespace) for p in patterns)


def overlap(a: str, b: str) -> bool:
    """Whether some namespace matches both patterns."""
    pa, pb = a.endswith("*"), b.endswith("*")
    if pa and pb:
        return a[:-1].startswith(b[:-1]) or b[:-1].startswith(a[:-1])
    if pa:
        return matches(a, b)
    if pb:
        return matches(b, a)
    return a == b


def whole_slabs(key: str, size: int, slab_size: int) -> None:
    """The pool and each tenant's share of it hold whole slabs only: a size between two would silently
    lose its last part slab, while check-config and the start-up log said the size asked for."""
    if size % slab_size:
        below = size // slab_size * slab_size
        nearest = " or ".join(f'"{exact_size(n)}"' for n in (below, below + slab_size) if n >= slab_size)
        raise ConfigError(
            key,
            f"{exact_size(size)} is not a whole number of slabs of {exact_size(slab_size)} (pool.slab_size): "
            f"L2 holds whole slabs only; write {nearest}",
        )


def default_capacity(cfg: Config) -> int:
    """The default tenant's share of L2: what the tenants leave of pool.capacity (0 is allowed)."""
    return cfg.pool.capacity - sum(t.capacity for t in cfg.tenants.values())


def check_tenants(cfg: Config, resolve: Callable[[Config, str], str]) -> None:
    """The [tenants.NAME] tables: names, members, namespace patterns that no two tenants share (L3 is shared
    storage kept apart by namespace: a namespace belongs to one tenant at most), capacities that fit in
    pool.capacity, and sockets of their own. `resolve` makes a configured path absolute."""
    if len(cfg.tenants) > MAX_TENANTS:
        raise ConfigError("tenants", f"at most {MAX_TENANTS} tenants, got {len(cfg.tenants)}")
    main = resolve(cfg, cfg.server.socket)
    sockets: dict[str, str] = {}
    seen: list[tuple[str, int, str]] = []  # (tenant, index, pattern) of the tenants checked so far
    for name, t in cfg.tenants.items():
        at = f"tenants.{name}"
        if name == DEFAULT:
            raise ConfigError(
                at, f"{DEFAULT!r} is the tenant of admitted peers that match no other: choose another name"
            )
        if not NAME_RE.fullmatch(name):
            raise ConfigError(at, "a tenant's name is 1 to 64 characters from A-Z a-z 0-9 _ -")
        for key in ("uids", "gids"):
            for i, n in enumerate(getattr(t, key)):
                if n < 0:
                    raise ConfigError(f"{at}.{key}[{i}]", f"a {key[:-1]} cannot be negative")
        if not (t.uids or t.gids or t.socket):
            raise ConfigError(at, "has no members: list uids or gids, or give it a socket of its own")
        if t.capacity <= 0:
            raise ConfigError(
                f"{at}.capacity",
                'is required and positive: the tenant\'s share of pool.capacity, such as capacity = "8GiB"',
            )
        if t.capacity < cfg.pool.slab_size:
            raise ConfigError(
                f"{at}.capacity", f"must hold at least one slab ({cfg.pool.slab_size} bytes, pool.slab_size)"
            )
        whole_slabs(f"{at}.capacity", t.capacity, cfg.pool.slab_size)
        if not t.namespaces:
            raise ConfigError(f"{at}.namespaces", "must list the namespaces it may use (names, or prefixes*)")
        for i, pattern in enumerate(t.namespaces):
            if not valid_pattern(pattern):
                raise ConfigError(
                    f"{at}.namespaces[{i}]",
                    f"{pattern!r} is neither a namespace (1 to {NAMESPACE_MAX_LEN} characters from A-Z a-z "
                    "0-9 . _ -) nor such a prefix followed by '*'",
                )
            for other, j, theirs in seen:
                if other != name and overlap(pattern, theirs):
                    raise ConfigError(
                        f"{at}.namespaces[{i}]",
                        f"{pattern!r} overlaps {theirs!r} of tenant {other!r} "
                        f"(tenants.{other}.namespaces[{j}]): a namespace may belong to one tenant at most",
                    )
        seen += [(name, i, p) for i, p in enumerate(t.namespaces)]
        if t.socket:
            path = resolve(cfg, t.socket)
            if path == main:
                raise ConfigError(f"{at}.socket", "is server.socket: a tenant's socket must be its own")
            if path == main + ".takeover":
                raise ConfigError(f"{at}.socket", "is the takeover endpoint of server.socket")
            if path in sockets:
                raise ConfigError(f"{at}.socket", f"is also tenant {sockets[path]!r}'s socket")
            sockets[path] = name
    given = sum(t.capacity for t in cfg.tenants.values())
    if given > cfg.pool.capacity:
        raise ConfigError(
            "tenants",
            f"the tenants' capacities add up to {given} bytes, more than pool.capacity ({cfg.pool.capacity})",
        )
