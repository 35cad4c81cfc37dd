"""Loading a TOML file into the typed schema, with errors that name the key path and what was expected."""

from __future__ import annotations

import dataclasses
import os
import stat
import tomllib
import types
import typing
from typing import Any, Literal, get_args, get_origin

from .errors import ConfigError
from .schema import MAX_CONCURRENCY, Config
from .tenants import check_tenants, whole_slabs
from .units import MiB, parse_duration, parse_size

# A configuration is a few KiB: past this, the path names something else (a log, a core file).
MAX_FILE_BYTES = 1 * MiB
# TOML's integers are 64-bit signed: a larger one cannot be meant, and would overflow where it is used.
MAX_INT = 2**63 - 1


def load(path: str | os.PathLike[str]) -> Config:
    """Read, parse and validate a configuration file. Every way a file can fail (missing, unreadable, not
    UTF-8, not TOML, empty, a bad value) is a ConfigError saying why."""
    path = os.fspath(path)
    text = _read(path)
    raw = _parse(path, text)
    if not raw:
        # A file emptied or cut short by accident would otherwise swap the running backend for the default
        # one on the next reload, and report it as applied.
        what = "is empty" if not text.strip() else "sets nothing (it holds only comments)"
        raise ConfigError(
            "",
            f"{path} {what}: refusing to run on the built-in defaults; write the settings (at least one, "
            'such as [storage] backend = "file")',
        )
    return from_dict(raw, base_dir=os.path.dirname(os.path.abspath(path)))


def socket_path(path: str | os.PathLike[str]) -> str:
    """The daemon's socket as the file at `path` names it (absolute), read even when the rest of the file
    does not validate: `hicached ctl reload` must reach the daemon to hear why it refuses the file."""
    path = os.fspath(path)
    raw = _parse(path, _read(path))
    server = raw.get("server", {})
    value = server.get("socket", Config().server.socket) if isinstance(server, dict) else None
    if not isinstance(value, str) or not value:
        raise ConfigError("server.socket", "must name the path of the Unix socket")
    return resolve_path(Config(base_dir=os.path.dirname(os.path.abspath(path))), value)


def _read(path: str) -> str:
    try:
        # O_NONBLOCK: a FIFO put in the file's place must not hang a reload until something writes to it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError("", f"configuration file {path!r} does not exist") from None
    except OSError as e:
        raise ConfigError("", f"cannot read configuration file {path!r}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError("", f"configuration file {path!r} is a directory")
        if not stat.S_ISREG(mode):
            raise ConfigError("", f"configuration file {path!r} is not a regular file")
        data = bytearray()
        while len(data) <= MAX_FILE_BYTES and (chunk := os.read(fd, MAX_FILE_BYTES + 1 - len(data))):
            data += chunk
    except OSError as e:
        raise ConfigError("", f"cannot read configuration file {path!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError("", f"{path} is larger than {MAX_FILE_BYTES >> 20} MiB: not a configuration file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(
            "", f"{path} is not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}, column {column}"
        ) from None


def _parse(path: str, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("", f"{path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError("", f"{path} is not valid TOML: its arrays or tables nest too deeply") from None


def from_dict(raw: dict[str, Any], base_dir: str = ".") -> Config:
    cfg = _build(Config, raw, "")
    cfg.base_dir = os.path.abspath(base_dir)
    cfg.present = frozenset(_paths(raw, ""))
    validate(cfg)
    return cfg


def _paths(raw: dict[str, Any], prefix: str) -> list[str]:
    out = []
    for name, value in raw.items():
        path = _join(prefix, name)
        out.append(path)
        if isinstance(value, dict):
            out += _paths(value, path)
    return out


def resolve_path(cfg: Config, value: str) -> str:
    """An absolute path: relative ones resolve against the directory of the configuration file."""
    return os.path.normpath(os.path.join(cfg.base_dir, os.path.expanduser(value)))


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(prefix, f"expected a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"[{prefix}]" if prefix else "the top level"
        known = ", ".join(sorted(fields))
        raise ConfigError(_join(prefix, unknown[0]), f"unknown key in {where}; known keys: {known}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _convert(hints[name], value, _join(prefix, name))
    return cls(**kwargs)


def _convert(hint: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    origin = get_origin(hint)
    if origin is typing.Annotated:
        base, marker = get_args(hint)[0], get_args(hint)[1]
        try:
            if marker == "size":
                return _in_range(parse_size(value))
            if marker == "duration":
                return parse_duration(value)
            if marker == "mode":
                return _parse_mode(value)
        except ValueError as e:
            raise ConfigError(path, str(e)) from None
        return _convert(base, value, path)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ConfigError(path, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin is dict:
        key, item = get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a table, got {type(value).__name__}")
        return {k: _convert(item, v, _join(path, k)) for k, v in value.items()}
    if origin is list:
        (item,) = get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {value!r}")
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(path, "internal: unions are not supported in the schema")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        try:
            return _in_range(value)
        except ValueError as e:
            raise ConfigError(path, str(e)) from None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    raise ConfigError(path, f"internal: unsupported schema type {hint!r}")


def _in_range(value: int) -> int:
    if not -MAX_INT - 1 <= value <= MAX_INT:
        raise ValueError(f"{value} is out of range: a 64-bit integer is at most {MAX_INT}")
    return value


def _parse_mode(value: Any) -> int:
    if isinstance(value, str):
        try:
            mode = int(value, 8)
        except ValueError:
            raise ValueError(f'expected an octal mode such as "0660", got {value!r}') from None
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise ValueError(f'expected an octal mode such as "0660", got {value!r}')
    if not 0 <= mode <= 0o777:
        raise ValueError(f"mode must be between 0000 and 0777, got {value!r}")
    return mode


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _positive(cfg: Any, prefix: str, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(_join(prefix, name), f"must be greater than 0, got {getattr(cfg, name)!r}")


def _at_most(cfg: Any, prefix: str, bound: int, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) > bound:
            raise ConfigError(_join(prefix, name), f"must be at most {bound}, got {getattr(cfg, name)!r}")


# What names the store of each network backend. Without it in the file the backend is refused, never pointed
# at a default address: that could be an application's own Redis, or a bucket of someone else's.
_NAMED_BY = {
    "redis": ("url", "its server", 'url = "redis://host:6379/0"'),
    "s3": ("bucket", "its bucket", 'bucket = "name", and endpoint_url for a store other than AWS'),
}


def check_backend(cfg: Config, backend: str) -> None:
    """Checks that `backend` can be built from `cfg`: the configured one (validate), or the one that
    `hicached ctl backend attach` names. The file backend has a default root; redis and s3 are used only
    where the file has their section and names their server in it."""
    st = cfg.storage
    if backend == "none":
        return
    if backend == "file":
        if not st.file.root:
            raise ConfigError("storage.file.root", "must name a directory for the file backend")
        return
    if backend not in _NAMED_BY:
        raise ConfigError("storage.backend", f"unknown backend {backend!r}: none, file, redis or s3")
    section = f"storage.{backend}"
    key, what, example = _NAMED_BY[backend]
    if section not in cfg.present:
        raise ConfigError(
            section,
            f"the {backend} backend needs a [{section}] section naming {what} ({example}); the file has "
            "none, and no default is assumed",
        )
    if f"{section}.{key}" not in cfg.present:
        raise ConfigError(
            f"{section}.{key}",
            f"must name {what} for the {backend} backend ({example}); no default is assumed",
        )
    if backend == "redis":
        url = st.redis.url
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("storage.redis.url", f"expected redis://, rediss:// or unix://, got {url!r}")
        if st.redis.cluster and url.startswith("unix://"):
            raise ConfigError(
                "storage.redis.url", "a Redis Cluster is reached over TCP: use redis:// or rediss://"
            )
    elif not st.s3.bucket:
        raise ConfigError("storage.s3.bucket", "must name a bucket for the s3 backend")


def validate(cfg: Config) -> None:
    """Checks that span keys, or bounds that the types alone do not express."""
    s = cfg.server
    if not s.socket:
        raise ConfigError("server.socket", "must name the path of the Unix socket")
    _positive(s, "server", "max_connections", "max_frame", "max_keys_per_request")
    _positive(s, "server", "max_inflight_per_connection", "max_prefetch_handles_per_connection")
    _positive(s, "server", "handshake_timeout", "request_timeout")
    if s.max_frame < 4096:
        raise ConfigError("server.max_frame", "must be at least 4KiB")
    if s.max_pending_bytes < 2 * s.max_frame:
        raise ConfigError(
            "server.max_pending_bytes",
            f"must be at least twice server.max_frame ({2 * s.max_frame} bytes), got {s.max_pending_bytes}",
        )
    for key in ("allowed_uids", "allowed_gids", "operator_uids", "operator_gids"):
        for i, n in enumerate(getattr(s, key)):
            if n < 0:
                raise ConfigError(f"server.{key}[{i}]", f"a {key[-4:-1]} cannot be negative")
    p = cfg.pool
    _positive(p, "pool", "capacity", "slab_size")
    if p.slab_size % 4096:
        raise ConfigError("pool.slab_size", "must be a multiple of 4KiB")
    if p.capacity < p.slab_size:
        raise ConfigError(
            "pool.capacity", f"must hold at least one slab ({p.slab_size} bytes, pool.slab_size)"
        )
    whole_slabs("pool.capacity", p.capacity, p.slab_size)
    if not 0.0 <= p.writeback_low_watermark < 1.0:
        raise ConfigError("pool.writeback_low_watermark", "must be between 0 and 1")
    if not 0.0 <= p.max_pinned_fraction <= 1.0:
        raise ConfigError("pool.max_pinned_fraction", "must be between 0 and 1")
    if not 0.0 <= p.reserve_max_fraction <= 1.0:
        raise ConfigError("pool.reserve_max_fraction", "must be between 0 and 1")
    st = cfg.storage
    _positive(
        st, "storage", "backup_concurrency", "backup_batch_pages", "backup_batch_bytes", "backup_queue_pages"
    )
    _positive(
        st,
        "storage",
        "prefetch_concurrency",
        "prefetch_batch_pages",
        "prefetch_batch_bytes",
        "prefetch_queue_pages",
    )
    _positive(st, "storage", "operation_timeout", "drain_timeout")
    if st.epoch_interval < 0:
        raise ConfigError("storage.epoch_interval", "must be 0 (clears stay on this node) or a duration")
    _positive(st.breaker, "storage.breaker", "failures", "probe_interval", "probe_max_interval")
    if st.breaker.stall_timeout < 0:
        raise ConfigError("storage.breaker.stall_timeout", "must be 0 (off) or a duration")
    if st.breaker.slow_factor != 0 and st.breaker.slow_factor <= 1:
        raise ConfigError("storage.breaker.slow_factor", "must be 0 (off) or more than 1")
    if not 0.0 < st.max_unbacked_fraction <= 1.0:
        raise ConfigError("storage.max_unbacked_fraction", "must be more than 0 and at most 1")
    _positive(st.retry, "storage.retry", "attempts", "max")
    if not 0.0 <= st.retry.jitter <= 1.0:
        raise ConfigError("storage.retry.jitter", "must be between 0 and 1")
    if st.file.io_threads < 0:
        raise ConfigError("storage.file.io_threads", "must be 0 (automatic) or a positive number of threads")
    _positive(st.file, "storage.file", "janitor_interval", "fleet_refresh")
    if st.backup_concurrency_busy < 0:
        raise ConfigError("storage.backup_concurrency_busy", "must be 0 (no limit) or a number of calls")
    if st.backup_defer < 0:
        raise ConfigError("storage.backup_defer", "must be 0 (no waiting) or a duration")
    if not 0 <= st.file.write_nice <= 19:
        raise ConfigError("storage.file.write_nice", "must be between 0 and 19")
    if not 0.0 < st.file.low_watermark < 1.0:
        raise ConfigError("storage.file.low_watermark", "must be between 0 and 1 (a fraction of max_bytes)")
    _at_most(st, "storage", MAX_CONCURRENCY, "backup_concurrency", "prefetch_concurrency")
    _at_most(st.file, "storage.file", MAX_CONCURRENCY, "io_threads")
    r = st.redis
    _positive(r, "storage.redis", "max_connections", "socket_timeout", "connect_timeout")
    if r.ttl < 0:
        raise ConfigError("storage.redis.ttl", f"must be 0 (no expiry) or more, got {r.ttl!r}")
    _positive(st.s3, "storage.s3", "max_connections", "connect_timeout", "read_timeout", "max_attempts")
    check_backend(cfg, st.backend)
    _positive(cfg.shutdown, "shutdown", "flush_timeout")
    if not 0.0 <= cfg.warmup.max_fraction <= 1.0:
        raise ConfigError("warmup.max_fraction", "must be between 0 and 1")
    if cfg.warmup.enabled and not cfg.warmup.state_file:
        raise ConfigError("warmup.state_file", "must name a file when warmup.enabled = true")
    _positive(cfg.regions, "regions", "max_per_connection", "max_bytes_per_connection", "copy_threads")
    _positive(cfg.regions, "regions", "copy_stall_timeout")
    check_tenants(cfg, resolve_path)
    if cfg.metrics.listen:
        host, sep, port = cfg.metrics.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            listen = cfg.metrics.listen
            raise ConfigError("metrics.listen", f"expected host:port such as 127.0.0.1:9464, got {listen!r}")
