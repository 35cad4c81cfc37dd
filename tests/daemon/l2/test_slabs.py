"""The slab allocator: offsets only, no memory."""

from __future__ import annotations

import pytest

from hicached.daemon.l2.slabs import ALIGN, SlabAllocator, slot_size

KiB = 1024
SLAB = 64 * KiB


@pytest.mark.parametrize(
    "page, slot",
    [(1, 4096), (4095, 4096), (4096, 4096), (4097, 8192), (100 * KiB, 100 * KiB), (100 * KiB + 1, 104 * KiB)],
)
def test_slot_size_rounds_up_to_4k(page: int, slot: int) -> None:
    assert slot_size(page) == slot
    assert slot_size(page) % ALIGN == 0


def test_constructor_checks() -> None:
    with pytest.raises(ValueError):
        SlabAllocator(SLAB * 4, 5000)
    with pytest.raises(ValueError):
        SlabAllocator(SLAB * 4, 0)
    with pytest.raises(ValueError):
        SlabAllocator(SLAB - 1, SLAB)


def test_capacity_is_whole_slabs() -> None:
    a = SlabAllocator(3 * SLAB + 100, SLAB)
    assert a.nslabs == 3
    assert a.capacity == 3 * SLAB
    assert len(a.free_slabs) == 3


def test_size_class_is_shared_per_slot_size() -> None:
    a = SlabAllocator(4 * SLAB, SLAB)
    c = a.size_class(16 * KiB)
    assert a.size_class(16 * KiB) is c
    assert a.size_class(8 * KiB) is not c
    assert c.per_slab == 4
    assert set(a.classes) == {16 * KiB, 8 * KiB}


def test_page_larger_than_a_slab_is_refused() -> None:
    a = SlabAllocator(4 * SLAB, SLAB)
    with pytest.raises(ValueError, match="larger than a slab"):
        a.size_class(SLAB + ALIGN)
    assert SLAB + ALIGN not in a.classes
    # Exactly one slab is the largest page accepted.
    c = a.size_class(SLAB)
    assert c.per_slab == 1
    assert a.alloc(c) == 0


def test_alloc_takes_a_slab_and_hands_out_its_slots_in_order() -> None:
    a = SlabAllocator(4 * SLAB, SLAB)
    c = a.size_class(16 * KiB)
    offsets = [a.alloc(c) for _ in range(4)]
    assert offsets == [0, 16 * KiB, 32 * KiB, 48 * KiB]
    assert c.slabs == {0}
    assert c.used == 4
    assert c.free == []
    assert len(a.free_slabs) == 3
    # The fifth slot comes from a second slab.
    assert a.alloc(c) == SLAB
    assert c.slabs == {0, 1}
    assert a.owner(1) is c
    assert a.owner(2) is None


def test_alloc_returns_none_when_pool_is_full() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    c = a.size_class(32 * KiB)
    got = [a.alloc(c) for _ in range(4)]
    assert None not in got
    assert len(set(got)) == 4
    assert a.alloc(c) is None
    assert c.used == 4  # a failed alloc is not counted


def test_free_makes_the_slot_reusable() -> None:
    a = SlabAllocator(SLAB, SLAB)
    c = a.size_class(32 * KiB)
    x, y = a.alloc(c), a.alloc(c)
    assert a.alloc(c) is None
    a.free(c, x)
    assert c.used == 1
    assert a.alloc(c) == x
    a.free(c, y)
    a.free(c, x)
    assert c.used == 0
    assert sorted(c.free) == [0, 32 * KiB]
    # Freed slots stay with their class: the slab is not returned to the pool.
    assert a.free_slabs == []
    assert c.slabs == {0}


def test_several_size_classes_share_the_pool_without_overlap() -> None:
    a = SlabAllocator(6 * SLAB, SLAB)
    sizes = [4 * KiB, 12 * KiB, 32 * KiB]
    taken: list[tuple[int, int]] = []
    for size in sizes:
        c = a.size_class(size)
        for _ in range(2 * c.per_slab):
            off = a.alloc(c)
            assert off is not None
            taken.append((off, size))
    assert a.free_slabs == []
    for size in sizes:
        assert len(a.classes[size].slabs) == 2
    # No two slots overlap, and none crosses a slab boundary.
    taken.sort()
    for (o1, s1), (o2, _) in zip(taken, taken[1:], strict=False):
        assert o1 + s1 <= o2
    for off, size in taken:
        assert off // SLAB == (off + size - 1) // SLAB
        assert a.slab_of(off) == off // SLAB
    assert a.alloc(a.classes[4 * KiB]) is None


def test_slot_size_that_does_not_divide_the_slab() -> None:
    a = SlabAllocator(SLAB, SLAB)
    c = a.size_class(24 * KiB)
    assert c.per_slab == 2
    assert [a.alloc(c), a.alloc(c), a.alloc(c)] == [0, 24 * KiB, None]


def test_slots_of() -> None:
    a = SlabAllocator(3 * SLAB, SLAB)
    assert a.slots_of(0) == []
    c = a.size_class(16 * KiB)
    a.alloc(c)
    a.alloc(c)
    a.alloc(c)
    a.alloc(c)
    a.alloc(c)
    assert a.slots_of(1) == [SLAB + i * 16 * KiB for i in range(4)]
    assert a.slots_of(2) == []


def test_move_slab_reassigns_a_free_slab() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    small = a.size_class(16 * KiB)
    big = a.size_class(32 * KiB)
    offs = [a.alloc(small) for _ in range(8)]
    assert a.alloc(big) is None
    for o in offs[:4]:  # slab 0 entirely
        a.free(small, o)
    a.move_slab(0, big)
    assert a.owner(0) is big
    assert small.slabs == {1}
    assert big.slabs == {0}
    assert all(a.slab_of(o) == 1 for o in small.free)
    assert small.free == []
    assert sorted(big.free) == [0, 32 * KiB]
    assert a.alloc(big) == 0
    assert a.alloc(big) == 32 * KiB
    assert a.alloc(big) is None
    assert a.alloc(small) is None
    assert a.slots_of(0) == [0, 32 * KiB]


def test_move_slab_refuses_a_slab_in_use() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    small = a.size_class(16 * KiB)
    big = a.size_class(32 * KiB)
    a.alloc(small)
    with pytest.raises(RuntimeError, match="in use"):
        a.move_slab(0, big)
    assert a.owner(0) is small
    assert big.slabs == set()
    assert big.free == []


def test_refused_move_slab_keeps_the_free_slots() -> None:
    a = SlabAllocator(SLAB, SLAB)
    small = a.size_class(16 * KiB)
    big = a.size_class(32 * KiB)
    a.alloc(small)
    with pytest.raises(RuntimeError):
        a.move_slab(0, big)
    assert sorted(small.free) == [16 * KiB, 32 * KiB, 48 * KiB]
    assert a.alloc(small) is not None


def test_move_slab_of_an_unowned_slab_takes_it_out_of_the_free_list() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    small = a.size_class(16 * KiB)
    big = a.size_class(32 * KiB)
    a.move_slab(0, small)
    assert 0 not in a.free_slabs
    big_offs = {a.alloc(big), a.alloc(big)}
    assert all(o is not None and a.slab_of(o) != 0 for o in big_offs)


def test_fair_share() -> None:
    a = SlabAllocator(10 * SLAB, SLAB)
    x = a.size_class(4 * KiB)
    y = a.size_class(8 * KiB)
    z = a.size_class(16 * KiB)
    # Nobody holds slabs: the asking class may have them all.
    assert a.fair_share(x) == 10
    a.alloc(x)
    assert a.fair_share(x) == 10  # the asker is not counted twice
    assert a.fair_share(y) == 5
    a.alloc(y)
    assert a.fair_share(z) == 3  # 10 // 3
    assert a.fair_share(x) == 5
    a.alloc(z)
    assert a.fair_share(x) == 3


def test_fair_share_is_at_least_one() -> None:
    a = SlabAllocator(2 * SLAB, SLAB)
    classes = [a.size_class(s * 4 * KiB) for s in (1, 2)]
    for c in classes:
        a.alloc(c)
    assert a.fair_share(a.size_class(16 * KiB)) == 1


def test_stats() -> None:
    a = SlabAllocator(4 * SLAB, SLAB)
    c = a.size_class(16 * KiB)
    a.size_class(32 * KiB)
    for _ in range(5):
        a.alloc(c)
    s = a.stats()
    assert s["slab_bytes"] == SLAB
    assert s["slabs"] == 4
    assert s["free_slabs"] == 2
    assert s["classes"][str(16 * KiB)] == {"slabs": 2, "used": 5, "free": 3}
    assert s["classes"][str(32 * KiB)] == {"slabs": 0, "used": 0, "free": 0}


def test_fair_share_follows_slabs_moving_between_classes() -> None:
    a = SlabAllocator(4 * SLAB, SLAB)
    x = a.size_class(16 * KiB)
    y = a.size_class(32 * KiB)
    xs = [a.alloc(x) for _ in range(4)]  # slab 0 of x
    assert a.fair_share(y) == 2
    for o in xs:
        a.free(x, o)
    a.move_slab(0, y)  # x holds no slab any more: it is not counted, y is counted once
    assert x.slabs == set() and y.slabs == {0}
    assert a.fair_share(y) == 4
    assert a.fair_share(x) == 2
    a.move_slab(1, x)  # a free slab: both hold one now
    assert a.fair_share(x) == a.fair_share(y) == 2
