"""Tiers in-process over a real pool and the real file connector, for the scheduler's tests: a configuration
rooted in a test's directory, a started Tiers, sessions, and pages written as an engine writes them."""

from __future__ import annotations

from hicached.connectors.file import FileConnector

from hicached import config
from hicached.common.protocol import ALLOC_WRITE
from hicached.daemon.l2.pool import Pool
from hicached.daemon.sched.tiers import Session, Tiers

PAGE = 64 * 1024


def cfg_for(tmp_path, capacity: str = "8MiB", attempts: int = 3, **storage):
    # A thread of the file connector that gets no CPU for 2 s on a loaded machine is no stalled disk: the
    # stall watch is left to the tests that ask for it (test_stall.py).
    storage.setdefault("breaker", {"stall_timeout": "60s"})
    return config.from_dict(
        {
            "pool": {"capacity": capacity, "slab_size": "1MiB", "prefault": False},
            "storage": {"file": {"root": "data"}, "retry": {"base": "1ms", "attempts": attempts}, **storage},
        },
        base_dir=str(tmp_path),
    )


async def make_tiers(tmp_path, connector="file", capacity="8MiB", attempts=3, **storage) -> Tiers:
    """A started Tiers; `connector`: "file" (the real one on tmp_path/data), a connector (started here), or
    None (no backend attached)."""
    cfg = cfg_for(tmp_path, capacity, attempts, **storage)
    conn = FileConnector(cfg) if connector == "file" else connector
    if conn is not None:
        await conn.start()
    t = Tiers(cfg, Pool(cfg.pool.capacity, prefault=False), conn)
    t.start()
    return t


async def close_tiers(t: Tiers) -> None:
    await t.stop()
    await t.backend.close()  # the connector attached, or the one its breaker detached and probes
    t.pool.close()


def session(t: Tiers, ns="ns1") -> Session:
    s = Session(peer="test")
    t.hello(s, ns, PAGE)
    return s


def write(t: Tiers, s: Session, keys: list[str], fill: int = 7) -> list[bool]:
    status, offsets = t.alloc(s, keys)
    written = []
    for k, st, off in zip(keys, status, offsets, strict=True):
        if st == ALLOC_WRITE:
            t.pool.view[off : off + PAGE] = bytes([fill]) * PAGE
            written.append(k)
    return t.commit(s, written)
