"""What the loader refuses, with its reason, instead of running on defaults: an empty or comment-only file,
bytes that are not UTF-8, a file that cannot be read or is not a file, numbers past 64 bits; a redis or s3
backend whose section (and server) the file does not name. `check-config` without a path reads
./hicached.toml, as `serve` does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hicached.config import ConfigError, check_backend, from_dict, load, socket_path
from hicached.config.loader import MAX_FILE_BYTES
from hicached.config.schema import MAX_CONCURRENCY


def _refused(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load(path)
    return e.value


def _write(tmp_path: Path, data: str | bytes, name: str = "hicached.toml") -> Path:
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "is empty"),
        ("   \n\t\n  \r\n", "is empty"),
        ("# hicached: the default configuration.\n# [storage]\n", "sets nothing (it holds only comments)"),
    ],
)
def test_a_file_that_sets_nothing_is_refused(tmp_path: Path, text: str, words: str) -> None:
    """A truncated file must not bring in the built-in defaults (the default file backend in place of a
    configured Redis, say)."""
    e = _refused(_write(tmp_path, text))
    assert words in str(e) and "refusing to run on the built-in defaults" in str(e)
    assert str(tmp_path / "hicached.toml") in str(e)


def test_an_empty_table_still_counts_as_a_setting(tmp_path: Path) -> None:
    assert load(_write(tmp_path, "[storage]\n")).storage.backend == "file"


def test_bytes_that_are_not_utf8_are_refused_with_their_place(tmp_path: Path) -> None:
    e = _refused(_write(tmp_path, b'[pool]\ncapacity = "1GiB"\n# caf\xe9\n'))
    assert "is not UTF-8 text: byte 0xe9 at line 3, column 6" in str(e)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "hicached.toml").mkdir()
    assert "is a directory" in str(_refused(tmp_path / "hicached.toml"))


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "hicached.toml")
    assert "is not a regular file" in str(_refused(tmp_path / "hicached.toml"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000; the directory case covers it")
def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    p = _write(tmp_path, "[pool]\n")
    p.chmod(0)
    assert "cannot read configuration file" in str(_refused(p)) and "Permission denied" in str(_refused(p))


def test_a_file_even_root_cannot_open_is_refused(tmp_path: Path) -> None:
    """A Unix socket in the file's place: open() fails (ENXIO) for root too."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "hicached.toml"))
        e = _refused(tmp_path / "hicached.toml")
    assert "cannot read configuration file" in str(e) and "No such device or address" in str(e)


def test_a_huge_file_is_refused(tmp_path: Path) -> None:
    p = _write(tmp_path, "# " + "x" * MAX_FILE_BYTES + "\n")
    assert "larger than 1 MiB" in str(_refused(p))


def test_arrays_nested_past_the_parsers_depth_are_refused(tmp_path: Path) -> None:
    p = _write(tmp_path, "a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert "nest too deeply" in str(_refused(p))


@pytest.mark.parametrize(
    "raw, path",
    [
        ({"server": {"max_connections": 2**63}}, "server.max_connections"),
        ({"pool": {"capacity": "99999999999TiB"}}, "pool.capacity"),
        ({"storage": {"backup_concurrency": MAX_CONCURRENCY + 1}}, "storage.backup_concurrency"),
        ({"storage": {"prefetch_concurrency": 10**9}}, "storage.prefetch_concurrency"),
        ({"storage": {"file": {"io_threads": 10**6}}}, "storage.file.io_threads"),
    ],
)
def test_numbers_too_large_to_mean_anything_are_refused(raw: dict, path: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    assert e.value.path == path and path not in e.value.message  # named once, in front


# A network backend only where the file names its server.


@pytest.mark.parametrize(
    "text, path",
    [
        ('[storage]\nbackend = "redis"\n', "storage.redis"),
        ('[storage]\nbackend = "s3"\n', "storage.s3"),
        ('[storage]\nbackend = "redis"\n[storage.redis]\nprefix = "x"\n', "storage.redis.url"),
        ('[storage]\nbackend = "s3"\n[storage.s3]\nendpoint_url = "http://h:9000"\n', "storage.s3.bucket"),
    ],
)
def test_a_network_backend_whose_server_is_not_named_is_refused(tmp_path: Path, text: str, path: str) -> None:
    """Before: the default redis://127.0.0.1:6379 (maybe an application's own Redis) or bucket "hicached"."""
    e = _refused(_write(tmp_path, text))
    assert e.path == path
    assert "no default is assumed" in e.message
    if "." not in path.removeprefix("storage."):
        assert f"[{path}]" in e.message  # the missing section is named as the operator writes it


@pytest.mark.parametrize(
    "text",
    [
        '[storage]\nbackend = "redis"\n[storage.redis]\nurl = "redis://10.0.0.5:6379/0"\n',
        '[storage]\nbackend = "redis"\nredis.url = "unix:///run/redis.sock"\n',  # dotted keys name it too
        '[storage]\nbackend = "redis"\nredis = { url = "redis://h:6379", cluster = true }\n',
        '[storage]\nbackend = "s3"\n[storage.s3]\nbucket = "kv"\n',
        '[storage]\nbackend = "file"\n',  # the file backend keeps its documented default root
    ],
)
def test_a_named_server_is_accepted(tmp_path: Path, text: str) -> None:
    load(_write(tmp_path, text))


def test_the_loader_remembers_what_the_file_set(tmp_path: Path) -> None:
    cfg = load(_write(tmp_path, '[storage]\nbackend = "file"\n[storage.redis]\nurl = "redis://h:1/0"\n'))
    assert cfg.present == {"storage", "storage.backend", "storage.redis", "storage.redis.url"}


def test_check_backend_judges_a_backend_other_than_the_configured_one() -> None:
    """What `ctl backend attach NAME` asks of the running configuration."""
    cfg = from_dict({"storage": {"backend": "file"}})
    check_backend(cfg, "file")
    for name, path in (("redis", "storage.redis"), ("s3", "storage.s3")):
        with pytest.raises(ConfigError) as e:
            check_backend(cfg, name)
        assert e.value.path == path
    named = from_dict({"storage": {"redis": {"url": "redis://h:1/0"}, "s3": {"bucket": "b"}}})
    check_backend(named, "redis")
    check_backend(named, "s3")
    bad = from_dict({"storage": {"redis": {"url": "http://h"}}, "server": {"socket": "s"}})
    with pytest.raises(ConfigError, match="storage.redis.url: expected redis://"):
        check_backend(bad, "redis")
    with pytest.raises(ConfigError, match="storage.file.root"):
        check_backend(from_dict({"storage": {"backend": "none", "file": {"root": ""}}}), "file")


# The socket, for `hicached ctl`, from a file the daemon would refuse.


def test_socket_path_is_read_from_a_file_that_does_not_validate(tmp_path: Path) -> None:
    p = _write(tmp_path, '[server]\nsocket = "s/d.sock"\n[pool]\ncapacity = "lots"\n')
    assert socket_path(p) == str(tmp_path / "s" / "d.sock")
    assert socket_path(_write(tmp_path, "")) == str(tmp_path / "run" / "hicached.sock")
    with pytest.raises(ConfigError, match="not valid TOML"):
        socket_path(_write(tmp_path, "[server\n"))
    with pytest.raises(ConfigError, match="server.socket"):
        socket_path(_write(tmp_path, "[server]\nsocket = 5\n"))


# `hicached check-config` and `serve` on these files.


def _hicached(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hicached", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_check_config_without_a_path_reads_hicached_toml_here(tmp_path: Path) -> None:
    _write(tmp_path, '[pool]\ncapacity = "64MiB"\nslab_size = "4MiB"\n[storage]\nbackend = "none"\n')
    r = _hicached(tmp_path, "check-config")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hicached.toml: OK") and "backend none" in r.stdout
    (tmp_path / "hicached.toml").unlink()
    r = _hicached(tmp_path, "check-config")
    assert r.returncode == 2 and "'hicached.toml' does not exist" in r.stderr


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "is empty"),
        (b"\n  \n", "is empty"),
        (b"[pool]\n\xff\xfe = 1\n", "is not UTF-8 text: byte 0xff at line 2, column 1"),
        (b'[storage]\nbackend = "redis"\n', "[storage.redis]"),
        (b'[storage]\nbackend = "s3"\n', "[storage.s3]"),
    ],
)
@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_check_config_and_serve_refuse_a_damaged_file(
    tmp_path: Path, command: str, data: bytes, words: str
) -> None:
    """Exit 2 with the reason, no traceback, and serve does not start on defaults."""
    _write(tmp_path, data)
    r = _hicached(tmp_path, command)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "invalid configuration" in r.stderr and words in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # serve never got as far as its socket


@pytest.mark.parametrize(
    "capacity, slab, nearest",
    [
        ("93744KiB", "32MiB", '"64MiB" or "96MiB"'),
        ("40MiB", "32MiB", '"32MiB" or "64MiB"'),
        ("1000000000", "32MiB", '"928MiB" or "960MiB"'),
        ("1536KiB", "1MiB", '"1MiB" or "2MiB"'),
    ],
)
def test_a_pool_capacity_that_is_not_a_whole_number_of_slabs_is_refused(
    capacity: str, slab: str, nearest: str
) -> None:
    """L2 holds whole slabs only: 93744KiB with 32MiB slabs gave a pool of 64MiB while check-config and the
    start-up log said 95993856 bytes. The loader names the nearest sizes it would take."""
    with pytest.raises(ConfigError) as e:
        from_dict({"pool": {"capacity": capacity, "slab_size": slab}, "storage": {"backend": "none"}})
    assert e.value.path == "pool.capacity"
    assert "is not a whole number of slabs" in str(e.value) and f"write {nearest}" in str(e.value)


def test_a_pool_capacity_of_whole_slabs_loads() -> None:
    cfg = from_dict({"pool": {"capacity": "96MiB", "slab_size": "32MiB"}, "storage": {"backend": "none"}})
    assert cfg.pool.capacity == 3 * cfg.pool.slab_size
