"""The configuration: units, schema conversion, validation errors that name the key, path resolution, and
`hicached check-config`."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hicached.config import Config, ConfigError, from_dict, load, resolve_path
from hicached.config.units import GiB, KiB, MiB, TiB, format_size, parse_duration, parse_size

from hicached import config

REPO = Path(__file__).resolve().parents[2]


def _error(raw: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    return e.value


def _write(tmp_path: Path, text: str, name: str = "hicached.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# Units.


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("512", 512),
        ("512b", 512),
        ("4KiB", 4 * KiB),
        ("4kib", 4 * KiB),
        ("512MiB", 512 * MiB),
        ("4GiB", 4 * GiB),
        ("2TiB", 2 * TiB),
        ("100kB", 100_000),
        ("100k", 100_000),
        ("3MB", 3_000_000),
        ("2G", 2_000_000_000),
        ("1TB", 10**12),
        ("1.5GiB", 3 * GiB // 2),
        (" 8 MiB ", 8 * MiB),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_int_passes_through() -> None:
    assert parse_size(4096) == 4096
    assert parse_size(0) == 0


@pytest.mark.parametrize(
    "bad",
    ["", "GiB", "4 GiBs", "-1GiB", "1e9", "4XB", "4 Gi B", "1.GiB", ".5GiB", "0x10", -1, True, 1.5, None, []],
)
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("500ms", 0.5),
        ("5s", 5.0),
        ("5", 5.0),
        ("2m", 120.0),
        ("2min", 120.0),
        ("1h", 3600.0),
        ("250us", 250e-6),
        ("1.5s", 1.5),
        ("10MS", 0.01),
        (" 3 s ", 3.0),
    ],
)
def test_parse_duration(text: str, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


def test_parse_duration_numbers_are_seconds() -> None:
    assert parse_duration(3) == 3.0
    assert isinstance(parse_duration(3), float)
    assert parse_duration(0.25) == 0.25


@pytest.mark.parametrize("bad", ["", "ms", "5 days", "5d", "-1s", "1e3s", "inf", "nan", -0.5, -1, True, None])
def test_parse_duration_rejects(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_toml_nan_and_inf_durations_are_refused(tmp_path: Path, bad: str) -> None:
    p = tmp_path / "h.toml"
    p.write_text(f"[storage]\noperation_timeout = {bad}\n")  # TOML floats, not strings
    with pytest.raises(config.ConfigError, match="storage.operation_timeout"):
        config.load(p)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0B"),
        (1023, "1023B"),
        (KiB, "1.0KiB"),
        (3 * MiB // 2, "1.5MiB"),
        (4 * GiB, "4.0GiB"),
        (TiB, "1.0TiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


# Conversion through the schema.


def test_empty_table_gives_the_defaults() -> None:
    cfg = from_dict({})
    assert cfg == dataclasses.replace(Config(), base_dir=os.path.abspath("."))
    assert cfg.pool.capacity == 1 * GiB
    assert cfg.storage.backend == "file"


def test_values_are_converted() -> None:
    cfg = from_dict(
        {
            "server": {"socket_mode": "0600", "max_frame": "16MiB", "handshake_timeout": "250ms"},
            "pool": {"capacity": "2GiB", "slab_size": 4 * MiB, "prefault": False},
            "storage": {
                "backend": "redis",
                "operation_timeout": 3,
                "redis": {"url": "rediss://h:6380/1", "ttl": "1h", "ssl_cert_reqs": "none"},
                "retry": {"attempts": 7, "base": "10ms", "jitter": 0},
            },
            "logging": {"level": "debug"},
        }
    )
    assert cfg.server.socket_mode == 0o600
    assert cfg.server.max_frame == 16 * MiB
    assert cfg.server.handshake_timeout == pytest.approx(0.25)
    assert cfg.pool.capacity == 2 * GiB
    assert cfg.pool.slab_size == 4 * MiB
    assert cfg.pool.prefault is False
    assert cfg.storage.backend == "redis"
    assert cfg.storage.operation_timeout == 3.0
    assert isinstance(cfg.storage.operation_timeout, float)
    assert cfg.storage.redis.url == "rediss://h:6380/1"
    assert cfg.storage.redis.ttl == 3600.0
    assert cfg.storage.redis.ssl_cert_reqs == "none"
    assert cfg.storage.retry.attempts == 7
    assert cfg.storage.retry.base == pytest.approx(0.01)
    assert cfg.storage.retry.jitter == 0.0
    assert isinstance(cfg.storage.retry.jitter, float)
    assert cfg.logging.level == "debug"
    # Sections not mentioned keep their defaults.
    assert cfg.storage.s3 == config.schema.S3Config()


@pytest.mark.parametrize(
    "raw, path",
    [
        ({"bogus": 1}, "bogus"),
        ({"base_dir": "/etc"}, "base_dir"),  # internal field, not a key
        ({"server": {"sockt": "x"}}, "server.sockt"),
        ({"pool": {"capacity_bytes": 1}}, "pool.capacity_bytes"),
        ({"storage": {"backends": "file"}}, "storage.backends"),
        ({"storage": {"retry": {"tries": 3}}}, "storage.retry.tries"),
        ({"storage": {"prefetch": {"polcy": "timeout"}}}, "storage.prefetch.polcy"),
        ({"storage": {"file": {"rot": "x"}}}, "storage.file.rot"),
        ({"storage": {"redis": {"uri": "redis://x"}}}, "storage.redis.uri"),
        ({"storage": {"s3": {"bucket_name": "b"}}}, "storage.s3.bucket_name"),
        ({"logging": {"lvl": "info"}}, "logging.lvl"),
        ({"shutdown": {"timeout": 1}}, "shutdown.timeout"),
    ],
)
def test_unknown_key_names_its_path(raw: dict, path: str) -> None:
    e = _error(raw)
    assert e.path == path
    assert str(e).startswith(f"{path}: ")
    assert "unknown key" in e.message


def test_unknown_key_lists_known_keys_of_its_section() -> None:
    e = _error({"storage": {"redis": {"uri": "x"}}})
    assert "[storage.redis]" in e.message
    assert "url" in e.message and "cluster" in e.message
    e = _error({"nope": 1})
    assert "top level" in e.message
    assert "pool" in e.message and "storage" in e.message
    assert "base_dir" not in e.message


def test_first_unknown_key_is_named_in_sorted_order() -> None:
    assert _error({"pool": {"zz": 1, "aa": 2}}).path == "pool.aa"


@pytest.mark.parametrize(
    "raw, path, words",
    [
        ({"server": 5}, "server", "expected a table"),
        ({"storage": {"redis": "redis://x"}}, "storage.redis", "expected a table"),
        ({"server": {"max_connections": "10"}}, "server.max_connections", "expected an integer"),
        ({"server": {"max_connections": True}}, "server.max_connections", "expected an integer"),
        ({"server": {"max_connections": 1.5}}, "server.max_connections", "expected an integer"),
        ({"server": {"allowed_uids": 1000}}, "server.allowed_uids", "expected a list"),
        ({"server": {"allowed_gids": [1, "wheel"]}}, "server.allowed_gids[1]", "expected an integer"),
        ({"server": {"allowed_uids": [False]}}, "server.allowed_uids[0]", "expected an integer"),
        ({"server": {"socket": 5}}, "server.socket", "expected a string"),
        ({"pool": {"prefault": 1}}, "pool.prefault", "expected true or false"),
        ({"pool": {"prefault": "yes"}}, "pool.prefault", "expected true or false"),
        ({"pool": {"writeback_low_watermark": "0.1"}}, "pool.writeback_low_watermark", "expected a number"),
        ({"pool": {"max_pinned_fraction": True}}, "pool.max_pinned_fraction", "expected a number"),
        ({"pool": {"capacity": "lots"}}, "pool.capacity", "expected a size"),
        ({"pool": {"capacity": -1}}, "pool.capacity", "negative"),
        ({"pool": {"capacity": 1.5}}, "pool.capacity", "expected a size"),
        ({"pool": {"capacity": {"a": 1}}}, "pool.capacity", "expected a size"),
        ({"server": {"request_timeout": "soon"}}, "server.request_timeout", "expected a duration"),
        ({"server": {"request_timeout": "-5s"}}, "server.request_timeout", "expected a duration"),
        ({"storage": {"retry": {"max": -1}}}, "storage.retry.max", "negative"),
        ({"storage": {"redis": {"url": 6379}}}, "storage.redis.url", "expected a string"),
        ({"storage": {"file": {"root": ["a"]}}}, "storage.file.root", "expected a string"),
    ],
)
def test_wrong_types_name_the_key(raw: dict, path: str, words: str) -> None:
    e = _error(raw)
    assert e.path == path
    assert words in e.message
    assert str(e).startswith(f"{path}: ")


@pytest.mark.parametrize(
    "raw, path",
    [
        ({"storage": {"backend": "nfs"}}, "storage.backend"),
        ({"storage": {"backend": "File"}}, "storage.backend"),
        ({"storage": {"backend": True}}, "storage.backend"),
        ({"storage": {"write_policy": "writeback"}}, "storage.write_policy"),
        ({"storage": {"prefetch": {"policy": "always"}}}, "storage.prefetch.policy"),
        ({"storage": {"redis": {"ssl_cert_reqs": "maybe"}}}, "storage.redis.ssl_cert_reqs"),
        ({"storage": {"s3": {"addressing_style": "dns"}}}, "storage.s3.addressing_style"),
        ({"storage": {"s3": {"checksum": "always"}}}, "storage.s3.checksum"),
        ({"logging": {"level": "trace"}}, "logging.level"),
    ],
)
def test_literal_choices(raw: dict, path: str) -> None:
    e = _error(raw)
    assert e.path == path
    assert "expected one of" in e.message


def test_literal_error_lists_the_choices() -> None:
    e = _error({"storage": {"backend": "nfs"}})
    for choice in ("'none'", "'file'", "'redis'", "'s3'"):
        assert choice in e.message
    assert "'nfs'" in e.message


# What names the store of each network backend, which the file must set for it to be used.
NAMED = {"redis": {"redis": {"url": "redis://10.0.0.5:6379/0"}}, "s3": {"s3": {"bucket": "b"}}}


@pytest.mark.parametrize("choice", ["none", "file", "redis", "s3"])
def test_every_backend_choice_is_accepted(choice: str) -> None:
    assert from_dict({"storage": {"backend": choice, **NAMED.get(choice, {})}}).storage.backend == choice


@pytest.mark.parametrize(
    "value, mode",
    [
        ("0660", 0o660),
        ("660", 0o660),
        ("0600", 0o600),
        ("0o640", 0o640),
        ("0", 0),
        ("0777", 0o777),
        (0o644, 0o644),
    ],
)
def test_socket_mode(value: Any, mode: int) -> None:
    assert from_dict({"server": {"socket_mode": value}}).server.socket_mode == mode


@pytest.mark.parametrize("value", ["0888", "rw-rw----", "", "1000", "-1", 0o1000, -1, 660, True, 6.6, None])
def test_socket_mode_rejects(value: Any) -> None:
    e = _error({"server": {"socket_mode": value}})
    assert e.path == "server.socket_mode"
    assert "mode" in e.message


# Checks that span keys or bounds.


@pytest.mark.parametrize(
    "raw, path",
    [
        ({"server": {"socket": ""}}, "server.socket"),
        ({"server": {"max_connections": 0}}, "server.max_connections"),
        ({"server": {"max_frame": 0}}, "server.max_frame"),
        ({"server": {"max_frame": "4095"}}, "server.max_frame"),
        ({"server": {"max_keys_per_request": -1}}, "server.max_keys_per_request"),
        ({"server": {"max_inflight_per_connection": 0}}, "server.max_inflight_per_connection"),
        (
            {"server": {"max_prefetch_handles_per_connection": 0}},
            "server.max_prefetch_handles_per_connection",
        ),
        ({"server": {"handshake_timeout": "0s"}}, "server.handshake_timeout"),
        ({"server": {"request_timeout": 0}}, "server.request_timeout"),
        ({"server": {"allowed_uids": [0, 1000, -1]}}, "server.allowed_uids[2]"),
        ({"pool": {"capacity": 0}}, "pool.capacity"),
        ({"pool": {"slab_size": 0}}, "pool.slab_size"),
        ({"pool": {"capacity": "16KiB", "slab_size": "32KiB"}}, "pool.capacity"),
        ({"pool": {"slab_size": "6KiB"}}, "pool.slab_size"),
        ({"pool": {"slab_size": 4097}}, "pool.slab_size"),
        ({"pool": {"slab_size": "1MB"}}, "pool.slab_size"),
        ({"pool": {"writeback_low_watermark": 1.0}}, "pool.writeback_low_watermark"),
        ({"pool": {"writeback_low_watermark": -0.1}}, "pool.writeback_low_watermark"),
        ({"pool": {"max_pinned_fraction": 1.01}}, "pool.max_pinned_fraction"),
        ({"pool": {"max_pinned_fraction": -0.5}}, "pool.max_pinned_fraction"),
        ({"storage": {"backup_concurrency": 0}}, "storage.backup_concurrency"),
        ({"storage": {"backup_batch_pages": 0}}, "storage.backup_batch_pages"),
        ({"storage": {"backup_queue_pages": 0}}, "storage.backup_queue_pages"),
        ({"storage": {"prefetch_concurrency": 0}}, "storage.prefetch_concurrency"),
        ({"storage": {"prefetch_batch_pages": 0}}, "storage.prefetch_batch_pages"),
        ({"storage": {"prefetch_queue_pages": -3}}, "storage.prefetch_queue_pages"),
        ({"storage": {"operation_timeout": 0}}, "storage.operation_timeout"),
        ({"storage": {"retry": {"attempts": 0}}}, "storage.retry.attempts"),
        ({"storage": {"retry": {"max": "0ms"}}}, "storage.retry.max"),
        ({"storage": {"retry": {"jitter": 1.5}}}, "storage.retry.jitter"),
        ({"storage": {"retry": {"jitter": -0.1}}}, "storage.retry.jitter"),
        ({"storage": {"file": {"io_threads": -1}}}, "storage.file.io_threads"),
        ({"storage": {"file": {"fleet_refresh": "0s"}}}, "storage.file.fleet_refresh"),
        ({"storage": {"backup_concurrency_busy": -1}}, "storage.backup_concurrency_busy"),
        ({"storage": {"backup_defer": "-1s"}}, "storage.backup_defer"),
        ({"storage": {"file": {"write_nice": 20}}}, "storage.file.write_nice"),
        ({"storage": {"file": {"write_nice": -1}}}, "storage.file.write_nice"),
        ({"storage": {"backend": "file", "file": {"root": ""}}}, "storage.file.root"),
        ({"storage": {"backend": "redis", "redis": {"url": "http://127.0.0.1:6379"}}}, "storage.redis.url"),
        ({"storage": {"backend": "redis", "redis": {"url": ""}}}, "storage.redis.url"),
        ({"storage": {"backend": "redis", "redis": {"url": "127.0.0.1:6379"}}}, "storage.redis.url"),
        (
            {"storage": {"backend": "redis", "redis": {"url": "unix:///run/r.sock", "cluster": True}}},
            "storage.redis.url",
        ),
        ({"storage": {"redis": {"max_connections": 0}}}, "storage.redis.max_connections"),
        ({"storage": {"redis": {"socket_timeout": 0}}}, "storage.redis.socket_timeout"),
        ({"storage": {"redis": {"connect_timeout": 0}}}, "storage.redis.connect_timeout"),
        ({"storage": {"backend": "s3", "s3": {"bucket": ""}}}, "storage.s3.bucket"),
        ({"storage": {"s3": {"max_connections": 0}}}, "storage.s3.max_connections"),
        ({"storage": {"s3": {"connect_timeout": 0}}}, "storage.s3.connect_timeout"),
        ({"storage": {"s3": {"read_timeout": 0}}}, "storage.s3.read_timeout"),
        ({"storage": {"s3": {"max_attempts": 0}}}, "storage.s3.max_attempts"),
        ({"shutdown": {"flush_timeout": 0}}, "shutdown.flush_timeout"),
    ],
)
def test_validation_names_the_key(raw: dict, path: str) -> None:
    e = _error(raw)
    assert e.path == path
    assert str(e).startswith(f"{path}: ")
    assert e.message


def test_capacity_smaller_than_slab_mentions_the_slab_key() -> None:
    e = _error({"pool": {"capacity": "16KiB", "slab_size": "32KiB"}})
    assert "pool.slab_size" in e.message
    assert str(32 * KiB) in e.message


def test_bad_redis_url_names_the_url() -> None:
    e = _error({"storage": {"backend": "redis", "redis": {"url": "http://h:1"}}})
    assert "http://h:1" in e.message


@pytest.mark.parametrize(
    "raw",
    [
        {"pool": {"capacity": "32KiB", "slab_size": "32KiB"}},
        {"pool": {"capacity": "4KiB", "slab_size": "4KiB"}},
        {"pool": {"writeback_low_watermark": 0.0, "max_pinned_fraction": 1.0}},
        {"pool": {"max_pinned_fraction": 0}},
        {"server": {"max_frame": 4096}},
        {"storage": {"retry": {"jitter": 0}}},
        {"storage": {"retry": {"jitter": 1}}},
        # Settings of a backend that is not chosen are not held against the configuration.
        {"storage": {"backend": "file", "redis": {"url": "http://nope"}, "s3": {"bucket": ""}}},
        {"storage": {"backend": "none", "file": {"root": ""}}},
        {"storage": {"backend": "redis", "redis": {"url": "redis://h:6379/0"}}},
        {"storage": {"backend": "redis", "redis": {"url": "rediss://h:6379/0"}}},
        {"storage": {"backend": "redis", "redis": {"url": "unix:///run/redis.sock"}}},
        {"storage": {"backend": "redis", "redis": {"url": "redis://h:7000", "cluster": True}}},
        {"storage": {"backend": "file", "redis": {"url": "unix:///run/r.sock", "cluster": True}}},
        {"storage": {"redis": {"ttl": 0}}},
        {"storage": {"backend": "s3", "s3": {"bucket": "b", "endpoint_url": "http://127.0.0.1:9000"}}},
        {"server": {"allowed_uids": [0, 1000], "allowed_gids": []}},
    ],
)
def test_valid_edges_are_accepted(raw: dict) -> None:
    from_dict(raw)


def test_negative_redis_ttl_is_refused_by_validate() -> None:
    # The loader refuses a negative duration already; validate guards configs built in code.
    cfg = from_dict({})
    cfg.storage.redis.ttl = -1.0
    with pytest.raises(ConfigError) as e:
        config.validate(cfg)
    assert e.value.path == "storage.redis.ttl"


def test_validate_can_be_called_on_a_changed_config() -> None:
    cfg = from_dict({})
    config.validate(cfg)
    cfg.pool.slab_size = 5000
    with pytest.raises(ConfigError) as e:
        config.validate(cfg)
    assert e.value.path == "pool.slab_size"


# Files and paths.


def test_load_sets_base_dir_and_resolves_relative_paths(tmp_path: Path) -> None:
    p = _write(tmp_path, '[server]\nsocket = "run/h.sock"\n[storage.file]\nroot = "../shared/data"\n')
    cfg = load(p)
    assert cfg.base_dir == str(tmp_path)
    assert resolve_path(cfg, cfg.server.socket) == str(tmp_path / "run" / "h.sock")
    assert resolve_path(cfg, cfg.storage.file.root) == str(tmp_path.parent / "shared" / "data")


def test_load_relative_file_path_gives_absolute_base_dir(tmp_path: Path, monkeypatch) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    _write(sub, "[pool]\ncapacity = '64MiB'\n")
    monkeypatch.chdir(tmp_path)
    cfg = load("etc/hicached.toml")
    assert cfg.base_dir == str(sub)
    assert os.path.isabs(cfg.base_dir)
    # Changing directory afterwards does not change where relative paths point.
    monkeypatch.chdir("/")
    assert resolve_path(cfg, "data") == str(sub / "data")


def test_load_accepts_pathlike(tmp_path: Path) -> None:
    cfg = load(_write(tmp_path, "[pool]\n"))
    assert cfg.base_dir == str(tmp_path)


def test_resolve_path_keeps_absolute_paths(tmp_path: Path) -> None:
    cfg = from_dict({}, base_dir=str(tmp_path))
    assert resolve_path(cfg, "/var/run/h.sock") == "/var/run/h.sock"
    assert resolve_path(cfg, "a/./b/../c") == str(tmp_path / "a" / "c")


def test_resolve_path_expands_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = from_dict({}, base_dir="/etc/hicached")
    assert resolve_path(cfg, "~/cache") == str(tmp_path / "home" / "cache")


def test_from_dict_base_dir_made_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = from_dict({}, base_dir="conf")
    assert cfg.base_dir == str(tmp_path / "conf")


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load(tmp_path / "nope.toml")
    assert "does not exist" in str(e.value)
    assert "nope.toml" in str(e.value)


def test_load_bad_toml(tmp_path: Path) -> None:
    p = _write(tmp_path, "[pool]\ncapacity = \n")
    with pytest.raises(ConfigError) as e:
        load(p)
    assert "not valid TOML" in str(e.value)
    assert "line 2" in str(e.value)


def test_load_error_names_nested_key(tmp_path: Path) -> None:
    p = _write(tmp_path, '[storage.redis]\nurl = "redis://h"\nclustr = true\n')
    with pytest.raises(ConfigError) as e:
        load(p)
    assert e.value.path == "storage.redis.clustr"


def test_toml_octal_integer_mode(tmp_path: Path) -> None:
    cfg = load(_write(tmp_path, "[server]\nsocket_mode = 0o640\n"))
    assert cfg.server.socket_mode == 0o640


def test_repository_config_loads() -> None:
    cfg = load(REPO / "hicached.toml")
    assert cfg.base_dir == str(REPO)
    assert cfg.storage.backend == "file"
    assert cfg.storage.write_policy == "write_through"
    assert cfg.pool.capacity == 1 * GiB
    assert cfg.pool.slab_size == 32 * MiB
    assert cfg.server.socket_mode == 0o660
    assert cfg.storage.prefetch.policy == "timeout"
    assert cfg.storage.prefetch.timeout_base == pytest.approx(0.05)
    assert cfg.storage.prefetch.timeout_per_page == pytest.approx(0.002)
    assert resolve_path(cfg, cfg.server.socket) == str(REPO / "run" / "hicached.sock")
    assert resolve_path(cfg, cfg.storage.file.root) == str(REPO / "data")
    config.validate(cfg)


# `hicached check-config`.


def _check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hicached", "check-config", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_config_repository_file() -> None:
    r = _check_config(REPO / "hicached.toml")
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout
    assert "backend file" in r.stdout


def test_check_config_good_file(tmp_path: Path) -> None:
    p = _write(tmp_path, '[pool]\ncapacity = "64MiB"\nslab_size = "4MiB"\n[storage]\nbackend = "none"\n')
    r = _check_config(p)
    assert r.returncode == 0, r.stderr
    assert "backend none" in r.stdout
    assert str(64 * MiB) in r.stdout


@pytest.mark.parametrize(
    "text, words",
    [
        ("[pool]\ncapacity = '1GiB'\nbogus = 1\n", "pool.bogus"),
        ("[storage.s3]\nbuckett = 'x'\n", "storage.s3.buckett"),
        ("[pool]\nslab_size = '6KiB'\n", "pool.slab_size"),
        ("[storage]\nbackend = 'redis'\n[storage.redis]\nurl = 'http://x'\n", "storage.redis.url"),
        ("[pool]\ncapacity = \n", "not valid TOML"),
        ("[pool\n", "not valid TOML"),
    ],
)
def test_check_config_bad_file_exits_2(tmp_path: Path, text: str, words: str) -> None:
    r = _check_config(_write(tmp_path, text))
    assert r.returncode == 2
    assert words in r.stderr
    assert "invalid configuration" in r.stderr
    assert "OK" not in r.stdout
    assert "Traceback" not in r.stderr


def test_check_config_missing_file_exits_2(tmp_path: Path) -> None:
    r = _check_config(tmp_path / "absent.toml")
    assert r.returncode == 2
    assert "does not exist" in r.stderr


@pytest.mark.parametrize(
    "backend, change, live, swap",
    [
        ("file", {"pool": {"capacity": "2GiB"}}, False, False),  # restart-only: reported, kept
        ("file", {"storage": {"file": {"root": "/elsewhere"}}}, True, True),
        ("file", {"storage": {"operation_timeout": "3s"}}, True, True),
        ("file", {"storage": {"retry": {"attempts": 9}}}, True, False),  # the backup's own backoff
        ("redis", {"storage": {"retry": {"attempts": 9}}}, True, True),  # redis-py's client retries
        ("file", {"storage": {"redis": {"prefix": "other"}}}, True, False),  # not the configured backend
    ],
)
def test_reload_plan_applies_live_keys_and_rebuilds_the_backend_when_its_options_change(
    backend: str, change: dict, live: bool, swap: bool
) -> None:
    from hicached.config.diff import plan

    old = from_dict({"storage": {"backend": backend, **NAMED.get(backend, {})}})
    merged: dict = {"storage": {"backend": backend, **NAMED.get(backend, {})}}
    for section, values in change.items():
        merged.setdefault(section, {}).update(values)
    p = plan(old, from_dict(merged))
    assert bool(p.live) == live and bool(p.restart) != live
    assert p.swap_backend == swap
    if not live:  # the restart-only key keeps its running value
        assert flatten_value(p.config, p.restart[0]) == flatten_value(old, p.restart[0])


def flatten_value(cfg: Config, key: str) -> Any:
    from hicached.config.diff import flatten

    return flatten(cfg)[key]


@pytest.mark.parametrize(
    "raw, path",
    [
        ({"storage": {"breaker": {"stall_timeout": "-1s"}}}, "storage.breaker.stall_timeout"),
        ({"storage": {"breaker": {"slow_factor": 1}}}, "storage.breaker.slow_factor"),
        ({"storage": {"breaker": {"slow_factor": -3}}}, "storage.breaker.slow_factor"),
        ({"storage": {"max_unbacked_fraction": 0}}, "storage.max_unbacked_fraction"),
        ({"storage": {"max_unbacked_fraction": 1.5}}, "storage.max_unbacked_fraction"),
        ({"storage": {"when_backlog_full": "block"}}, "storage.when_backlog_full"),
    ],
)
def test_stall_and_backlog_keys_out_of_range_name_the_key(raw: dict, path: str) -> None:
    assert _error(raw).path == path


def test_stall_and_backlog_defaults_and_off_switches() -> None:
    st = from_dict({}).storage
    assert (st.breaker.stall_timeout, st.breaker.slow_factor) == (2.0, 20.0)
    assert (st.max_unbacked_fraction, st.when_backlog_full) == (0.5, "drop_oldest")
    off = from_dict(
        {"storage": {"breaker": {"stall_timeout": 0, "slow_factor": 0}, "when_backlog_full": "refuse"}}
    )
    assert (off.storage.breaker.stall_timeout, off.storage.breaker.slow_factor) == (0.0, 0.0)
