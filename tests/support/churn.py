"""Writers that churn a daemon for a while, each in a process of its own, and report what was acknowledged.

    python -m churn store SOCKET NAMESPACE PAGE_BYTES SECONDS OUT
    python -m churn region SOCKET NAMESPACE PAGE_BYTES SECONDS OUT

`store` stores batches of new pages with Client.store; `region` writes them into a registered host region
and stores them with store_pages. Every page's bytes follow from its key (`page_of`), so a reader can tell a
page that holds another page's bytes. OUT receives the acknowledged keys, one a line."""

from __future__ import annotations

import hashlib
import sys
import time

from hicached import Client, HicachedError, shared_buffer

BATCH = 8


def page_of(key: str, size: int) -> bytes:
    """The bytes every page stored under `key` holds: its key's digest, repeated."""
    digest = hashlib.sha256(key.encode()).digest()
    return (digest * (size // len(digest) + 1))[:size]


def churn(kind: str, socket: str, namespace: str, page_bytes: int, seconds: float) -> list[str]:
    acked: list[str] = []
    deadline = time.monotonic() + seconds
    n = 0
    with Client(socket, namespace, page_bytes, timeout=30) as c:
        region = handle = None
        if kind == "region":
            region = shared_buffer(4 * BATCH * page_bytes, name="churn")
            handle = c.register_region(region, page_bytes)
        while time.monotonic() < deadline:
            keys = [f"{kind}-{n + i}" for i in range(BATCH)]
            n += BATCH
            try:
                if kind == "store":
                    ok = c.store(keys, [page_of(k, page_bytes) for k in keys])
                else:
                    first = (n // BATCH) % 4 * BATCH  # a window of the region, rewritten every fourth batch
                    for i, k in enumerate(keys):
                        start = (first + i) * page_bytes
                        region[start : start + page_bytes].numpy()[:] = memoryview(page_of(k, page_bytes))
                    ok = c.store_pages(handle, list(range(first, first + BATCH)), keys)
            except HicachedError:
                continue  # busy or timed out: those pages were not acknowledged
            acked += [k for k, good in zip(keys, ok, strict=True) if good]
    return acked


def main(argv: list[str]) -> int:
    kind, socket, namespace, page_bytes, seconds, out = argv
    acked = churn(kind, socket, namespace, int(page_bytes), float(seconds))
    with open(out, "w") as f:
        f.write("\n".join(acked))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
