"""Which pages this node wrote to L3, as far as it can tell: for the fleet's metric of L3 hits on pages
that other nodes stored (the cross-node hits that a shared L3 is for).

A Bloom filter of the (namespace, key) of every page this node's backup wrote: 8 Mi bits (1 MiB), two
probes a key. Read from L3 and not in it: another node's page, for sure. In it: this node's, or (a false
positive) another node's that looks like one: about 1 in 100 while it holds a million keys or less. Once
half its bits are set it starts empty again: pages this node wrote before then count as other nodes' from
then on. An estimate for an operator, never used to decide anything.
"""

from __future__ import annotations

import xxhash

BITS = 1 << 23
_MASK = BITS - 1


class KeysWritten:
    __slots__ = ("_bits", "_set", "resets")

    def __init__(self) -> None:
        self._bits = bytearray(BITS // 8)
        self._set = 0  # bits set
        self.resets = 0

    @staticmethod
    def _probes(ns: str, key: str) -> tuple[int, int]:
        h = xxhash.xxh3_64_intdigest(f"{ns}/{key}".encode())
        return h & _MASK, (h >> 32) & _MASK

    def add(self, ns: str, key: str) -> None:
        bits = self._bits
        for bit in self._probes(ns, key):
            byte, mask = bit >> 3, 1 << (bit & 7)
            if not bits[byte] & mask:
                bits[byte] |= mask
                self._set += 1
        if self._set > BITS // 2:
            self._bits = bytearray(BITS // 8)
            self._set = 0
            self.resets += 1

    def __contains__(self, page: tuple[str, str]) -> bool:
        bits = self._bits
        return all(bits[bit >> 3] & (1 << (bit & 7)) for bit in self._probes(*page))
