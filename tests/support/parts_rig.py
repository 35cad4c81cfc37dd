"""Small real collaborators for the unit tests of the scheduler's parts, each part built alone: a small
configuration and pool, an in-memory L3 store, slot headers that record what they hear, and the page life
over them (what hicached.daemon.sched.tiers.Tiers.__init__ wires, one piece at a time)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence

from hicached.config import Config
from hicached.connectors.base import Capabilities, Connector, Hold

from hicached import config
from hicached.common.retry import Backoff
from hicached.daemon.l2.index import Entry
from hicached.daemon.l2.life import PageLife
from hicached.daemon.l2.pool import Pool
from hicached.daemon.l2.slabs import SlabAllocator
from hicached.daemon.sched.activity import EngineActivity
from hicached.daemon.sched.backend import Backend
from hicached.daemon.sched.backup import Backup
from hicached.daemon.sched.reports import EveryMinute
from hicached.daemon.sched.writeback import WritePolicy

KiB = 1024
PAGE = 16 * KiB  # a slot of its own size: 4 to a slab
SLAB = 64 * KiB
CAPACITY = 256 * KiB  # 4 slabs, 16 slots


def small_cfg(tmp_path, capacity: int = CAPACITY, pool: dict | None = None, **storage) -> Config:
    """A configuration of a pool of `capacity` bytes in slabs of 64 KiB (pages of PAGE: 4 a slab), quick
    retries, and no stall watch."""
    storage.setdefault("retry", {"base": "1ms", "max": "1ms", "attempts": 2})
    storage.setdefault("breaker", {"stall_timeout": "60s"})
    storage.setdefault("file", {"root": "data"})
    return config.from_dict(
        {
            "pool": {"capacity": capacity, "slab_size": SLAB, "prefault": False, **(pool or {})},
            "storage": storage,
        },
        base_dir=str(tmp_path),
    )


class MemStore(Connector):
    """An L3 store in memory: every call yields to the event loop once. While `refuse`, every page of a put
    is refused (as a full disk refuses them) without the call failing."""

    name = "mem"
    capabilities = Capabilities(shared=False, persistent=False, ttl=False)

    def __init__(self, tag: str = "a") -> None:
        super().__init__()
        self.tag = tag
        self.data: dict[tuple[str, str], bytes] = {}
        self.refuse = False
        self.puts = 0  # put calls made

    def location(self) -> tuple:
        return ("mem", self.tag)

    async def put(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[memoryview],
        checksums: Sequence[int | None] | None = None,
        hold: Hold | None = None,
    ) -> list[bool]:
        self.puts += 1
        await asyncio.sleep(0)
        if self.refuse:
            return [False] * len(keys)
        for key, payload in zip(keys, payloads, strict=True):
            self.data[(namespace, key)] = bytes(payload)
        return [True] * len(keys)

    async def get_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], hold: Hold | None = None
    ) -> list[bool]:
        await asyncio.sleep(0)
        out = []
        for key, buf in zip(keys, buffers, strict=True):
            got = self.data.get((namespace, key))
            if got is None or len(got) != len(buf):
                out.append(False)
                continue
            buf[:] = got
            out.append(True)
        return out

    async def exists(self, namespace: str, keys: Sequence[str]) -> int:
        await asyncio.sleep(0)
        n = 0
        for key in keys:
            if (namespace, key) not in self.data:
                break
            n += 1
        return n

    async def delete(self, namespace: str, keys: Sequence[str]) -> int:
        return sum(self.data.pop((namespace, k), None) is not None for k in keys)


class Records:
    """Slot headers (hicached.daemon.l2.index.PageRecords) that write down what they are told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def commit(self, e: Entry) -> None:
        self.events.append(("commit", e.key))

    def in_l3(self, e: Entry) -> None:
        self.events.append(("in_l3", e.key))

    def clear(self, entries: list[Entry]) -> None:
        self.events.append(("clear", sorted(e.key for e in entries)))

    def l3(self, location: str | None) -> None:
        self.events.append(("l3", location))


class Flags:
    """What a PageLife asks of the world: whether a backend is attached, whether one is configured, and the
    losses it told (one number a call)."""

    def __init__(self, attached: bool = True, configured: bool = True) -> None:
        self.attached = attached
        self.configured = configured
        self.lost: list[int] = []


def make_life(
    pool: Pool,
    counters: collections.Counter[str],
    flags: Flags,
    capacity: int | None = None,
    on_short=None,
    records=None,
) -> tuple[PageLife, SlabAllocator]:
    """A PageLife over one allocator of the whole pool (or its first `capacity` bytes), telling `records`
    (the slot headers' part) of the pages' moves."""
    alloc = SlabAllocator(capacity or pool.size, SLAB)
    life = PageLife(
        [alloc],
        pool,
        counters,
        attached=lambda: flags.attached,
        configured=lambda: flags.configured,
        lost=flags.lost.append,
        on_short=on_short,
        records=records,
    )
    return life, alloc


def used(alloc: SlabAllocator) -> int:
    """Slots in use over every size class of the allocator."""
    return sum(c.used for c in alloc.classes.values())


def page_bytes(key: str, size: int = PAGE) -> bytes:
    """The bytes of the page of `key` (a pattern of its own)."""
    seed = key.encode() + b"|"
    return (seed * (size // len(seed) + 1))[:size]


def store(life: PageLife, ns: str, keys: list[str], size: int = PAGE) -> list[tuple[Entry, bool]]:
    """What a writer does: a slot each, its bytes, then publish. Returns publish's answers."""
    entries = life.start_writes(ns, keys, size)
    assert len(entries) == len(keys), "the pool has no slot left for these pages"
    out = []
    for e in entries:
        life.pool.view[e.offset : e.offset + size] = page_bytes(e.key, size)
        out.append(life.publish(e, None))
    return out


class World:
    """The collaborators the scheduler's parts are handed, wired as Tiers.__init__ wires them: a backend
    holding `connector` (None: none attached), the page life over a small pool, the backup (its workers not
    started: start() them where a test wants pages written) and the engines' activity on a clock the test
    sets (`now`). The test builds the part it tests; a WritePolicy it sets as `policy` is asked what the
    backup's pace and the index's shortage are, as in Tiers. `records`: told of the pages' moves, as the
    slot headers are."""

    def __init__(
        self,
        tmp_path,
        connector: Connector | None = None,
        capacity: int = CAPACITY,
        records=None,
        **storage,
    ):
        self.cfg = small_cfg(tmp_path, capacity, pool=storage.pop("pool", None), **storage)
        self.pool = Pool(self.cfg.pool.capacity, prefault=False)
        self.counters: collections.Counter[str] = collections.Counter()
        self.now = 0.0
        self.activity = EngineActivity(clock=lambda: self.now)
        self.backend = Backend(self.cfg, self.counters)
        self.backend.current = connector
        if connector is not None:
            self.backend.note_location(connector)
        self.lost: list[int] = []
        self.policy: WritePolicy | None = None
        self.alloc = SlabAllocator(self.cfg.pool.capacity, self.cfg.pool.slab_size)
        self.life = PageLife(
            [self.alloc],
            self.pool,
            self.counters,
            attached=lambda: self.backend.current is not None,
            configured=lambda: self.cfg.storage.backend != "none",
            lost=self._lost,
            on_short=lambda nbytes, arena: self.policy.backlog_full(nbytes, arena) if self.policy else 0,
            records=records,
        )
        self.index = self.life.index
        st = self.cfg.storage
        self.backup = Backup(
            self.life,
            self.pool,
            self.backend,
            self.counters,
            st.backup_concurrency,
            st.backup_batch_pages,
            st.backup_batch_bytes,
            st.backup_queue_pages,
            Backoff.from_config(st.retry),
            allowed=lambda: self.policy.calls_allowed() if self.policy else 0,
            defer=lambda: self.policy.defer() if self.policy else 0.0,
        )

    def _lost(self, n: int) -> None:
        self.lost.append(n)
        self.counters["backup.lost"] += n  # as Tiers' EveryMinute counts them

    def make_policy(self) -> WritePolicy:
        """The write policy over these collaborators (as Tiers builds it), set as `policy`."""
        dropped = EveryMinute(self.counters, "backup.dropped", logging.WARNING)
        self.policy = WritePolicy(self.cfg, self.index, self.backup, self.backend, self.activity, dropped)
        return self.policy

    def used(self) -> int:
        return used(self.alloc)

    def bytes_at(self, offset: int, size: int = PAGE) -> bytes:
        return bytes(self.pool.slot(offset, size))

    def write(self, offset: int, key: str, size: int = PAGE) -> None:
        """An engine copies the page of `key` into the slot at `offset`."""
        self.pool.view[offset : offset + size] = page_bytes(key, size)

    def evict_all(self, ns: str = "evict", size: int = PAGE) -> int:
        """Takes every slot the pool can give (evicting what can be) and gives them back: how many."""
        taken = self.life.start_writes(ns, [f"evict{i}" for i in range(self.cfg.pool.capacity // size)], size)
        for e in taken:
            self.life.abort_write(e)
        return len(taken)

    async def __aenter__(self) -> World:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self.policy is not None:
            await self.policy.stop()
        await self.backup.stop()
        await self.backend.close()
        self.pool.close()
