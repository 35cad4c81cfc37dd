"""Slab allocator in the spirit of memcached: the pool is cut into equal slabs, each slab is given to one
size class and cut into slots of that class's size. Pure bookkeeping over offsets; no memory is touched."""

from __future__ import annotations

from collections.abc import Callable

ALIGN = 4096


def slot_size(page_bytes: int) -> int:
    """Slot size of a page: rounded up to 4 KiB, so pages stay page-aligned for direct I/O and DMA."""
    return (page_bytes + ALIGN - 1) // ALIGN * ALIGN


class SizeClass:
    __slots__ = ("slot_bytes", "per_slab", "slabs", "free", "used", "arena")

    def __init__(self, slot_bytes: int, slab_bytes: int, arena: int = 0) -> None:
        self.slot_bytes = slot_bytes
        self.arena = arena  # the pool arena (tenant) whose slabs it takes: hicached.daemon.l2.pool
        self.per_slab = slab_bytes // slot_bytes
        self.slabs: set[int] = set()
        self.free: list[int] = []  # free slot offsets, used as a stack
        self.used = 0


class SlabAllocator:
    """The slabs of `capacity` bytes of the pool from offset `base` (one arena: a tenant's share; the whole
    pool where there are no tenants). Offsets are the pool's; slab numbers count from `base`. `on_assign(slab,
    slot_bytes)` hears of every slab given to a class (the slot headers' slab table)."""

    def __init__(
        self,
        capacity: int,
        slab_bytes: int,
        base: int = 0,
        arena: int = 0,
        on_assign: Callable[[int, int], None] | None = None,
    ) -> None:
        if slab_bytes % ALIGN or slab_bytes <= 0:
            raise ValueError("slab size must be a positive multiple of 4KiB")
        self.base = base
        self.arena = arena
        self.slab_bytes = slab_bytes
        self.nslabs = capacity // slab_bytes
        if self.nslabs < 1:
            raise ValueError("capacity must hold at least one slab")
        self.capacity = self.nslabs * slab_bytes
        self.free_slabs = list(range(self.nslabs - 1, -1, -1))
        self.classes: dict[int, SizeClass] = {}
        self._owner: list[SizeClass | None] = [None] * self.nslabs
        self._active = 0  # classes holding at least one slab, kept as slabs move: fair_share is O(1)
        self.on_assign = on_assign

    def size_class(self, slot_bytes: int) -> SizeClass:
        cls = self.classes.get(slot_bytes)
        if cls is None:
            if slot_bytes > self.slab_bytes:
                raise ValueError(f"page of {slot_bytes} bytes is larger than a slab ({self.slab_bytes})")
            cls = self.classes[slot_bytes] = SizeClass(slot_bytes, self.slab_bytes, self.arena)
        return cls

    def alloc(self, cls: SizeClass) -> int | None:
        """A free slot of `cls`, taking a free slab if needed; None when neither is left."""
        if not cls.free and not self._grow(cls):
            return None
        cls.used += 1
        return cls.free.pop()

    def alloc_many(self, cls: SizeClass, n: int) -> list[int]:
        """Up to `n` free slots of `cls` (taking free slabs as needed), in the order n alloc() calls would
        hand them out; fewer when neither free slots nor free slabs are left."""
        out: list[int] = []
        while len(out) < n and (cls.free or self._grow(cls)):
            k = min(n - len(out), len(cls.free))
            out += cls.free[: -k - 1 : -1]
            del cls.free[-k:]
        cls.used += len(out)
        return out

    def free(self, cls: SizeClass, offset: int) -> None:
        cls.used -= 1
        cls.free.append(offset)

    def _grow(self, cls: SizeClass) -> bool:
        if not self.free_slabs:
            return False
        slab = self.free_slabs.pop()
        self._assign(slab, cls)
        return True

    def _assign(self, slab: int, cls: SizeClass) -> None:
        if self.on_assign is not None:
            self.on_assign(slab, cls.slot_bytes)
        self._owner[slab] = cls
        self._active += not cls.slabs
        cls.slabs.add(slab)
        base = self.base + slab * self.slab_bytes
        # Pushed in reverse so slots are handed out from the start of the slab.
        cls.free.extend(base + i * cls.slot_bytes for i in range(cls.per_slab - 1, -1, -1))

    def slab_of(self, offset: int) -> int:
        return (offset - self.base) // self.slab_bytes

    def slots_of(self, slab: int) -> list[int]:
        cls = self._owner[slab]
        if cls is None:
            return []
        base = self.base + slab * self.slab_bytes
        return [base + i * cls.slot_bytes for i in range(cls.per_slab)]

    def owner(self, slab: int) -> SizeClass | None:
        return self._owner[slab]

    def move_slab(self, slab: int, to: SizeClass) -> None:
        """Give a slab whose slots are all free to another class (memcached's slab reassign)."""
        src = self._owner[slab]
        if src is not None:
            slots = set(self.slots_of(slab))
            keep = [o for o in src.free if o not in slots]
            if len(src.free) - len(keep) != len(slots):
                raise RuntimeError("slab still has slots in use")
            src.free = keep
            src.slabs.discard(slab)
            self._active -= not src.slabs
        else:
            self.free_slabs.remove(slab)
        self._assign(slab, to)

    def restore(self, slabs: list[int], used: set[int]) -> None:
        """A kept pool's slabs as the daemon before left them, into this fresh allocator: `slabs[s]` the slot
        size of the class slab s was given to (0: free), `used` the slots (pool offsets) in use; the rest of
        the slots of those slabs are free. RuntimeError if this allocator has handed out slots already or
        has another number of slabs."""
        fresh = not any(c.used for c in self.classes.values())
        if not fresh or self.nslabs != len(slabs) or len(self.free_slabs) != self.nslabs:
            raise RuntimeError("a snapshot is restored into a fresh index of the same geometry only")
        assigned = [s for s, slot in enumerate(slabs) if slot]
        # move_slab takes a free slab with list.remove: the slabs given out first, so each is found at once.
        taken = set(assigned)
        self.free_slabs = assigned + [s for s in self.free_slabs if s not in taken]
        for slab in assigned:
            self.move_slab(slab, self.size_class(slabs[slab]))
        for cls in self.classes.values():
            keep = [o for o in cls.free if o not in used]
            cls.used += len(cls.free) - len(keep)
            cls.free = keep

    def fair_share(self, asking: SizeClass) -> int:
        """Slabs each active class (those holding slabs, and the one asking) is entitled to before it must
        evict its own pages rather than take a slab from another class."""
        # O(1): this runs for every page a full pool takes in.
        return max(1, self.nslabs // (self._active + (not asking.slabs)))

    def stats(self) -> dict:
        return {
            "slab_bytes": self.slab_bytes,
            "slabs": self.nslabs,
            "free_slabs": len(self.free_slabs),
            "classes": {
                str(c.slot_bytes): {"slabs": len(c.slabs), "used": c.used, "free": len(c.free)}
                for c in self.classes.values()
            },
        }
