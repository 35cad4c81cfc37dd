"""Eviction policies on a trace, through the L2 index alone (no daemon, no bytes): each request's leading
pages that the index holds are hits, loaded (leased and let go), the rest stored (allocated, or used again
where present), one 16 KiB page a block, as bench/bench_trace.py's engine does through a daemon. Seconds per
capacity instead of minutes, and the same policy code: what `pool.eviction`'s constants were chosen on.

    python bench/eviction_replay.py TRACE [--capacities 1984,5824,10240] [--eviction lru,slru,auto]

Prints per capacity each policy's L2 hit rate and its ratio to LRU's, and for auto whom it followed at
the end and how often it switched. Capacities are rounded down to whole slabs of 64 pages. Python's hash
seed decides which keys auto samples: run it with PYTHONHASHSEED=0,1,2... to see the spread."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hicached.daemon.l2.index import READY, PageIndex  # noqa: E402
from hicached.daemon.l2.slabs import SlabAllocator  # noqa: E402

PAGE = 16 << 10
SLAB_PAGES = 64
NS = "trace"


def replay(requests: list[list[int]], capacity: int, eviction: str) -> tuple[float, dict | None]:
    """L2 hit rate over every block of the trace; auto's referee's state at the end."""
    idx = PageIndex(SlabAllocator(capacity * PAGE, SLAB_PAGES * PAGE), eviction=eviction)
    hits = blocks = 0
    for ids in requests:
        keys = [f"{b:064x}" for b in ids]
        held = []
        for k in keys:
            e = idx.get(NS, k)
            if e is None or e.state != READY:
                break
            held.append(e)
        hits += len(held)
        blocks += len(keys)
        idx.lease_all(held)
        idx.unlease_all(held)
        for k in keys[len(held) :]:
            e = idx.get(NS, k)
            if e is not None:
                idx.touch(e)  # stored again
                continue
            e = idx.allocate(NS, k, PAGE, READY)
            if e is not None:
                idx.update(e)
    return hits / blocks, idx.stats().get("eviction")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--capacities", default="1984,5824,10240,19968")
    p.add_argument("--eviction", default="lru,slru,auto")
    a = p.parse_args()
    requests = [json.loads(line)["hash_ids"] for line in a.trace.open()]
    policies = a.eviction.split(",")
    print(f"{a.trace.name}: {len(requests):,} requests")
    print("| L2 pages | " + " | ".join(policies) + " | auto at the end |")
    print("|---" * (len(policies) + 2) + "|")
    for capacity in (int(c) // SLAB_PAGES * SLAB_PAGES for c in a.capacities.split(",")):
        rates, state = {}, None
        for ev in policies:
            rates[ev], s = replay(requests, capacity, ev)
            state = s or state
        lru = rates.get("lru")
        cells = [f"{r:.4f}" + (f" ({r / lru:.3f}x)" if lru and e != "lru" else "") for e, r in rates.items()]
        end = f"follows {state['follows']}, {state['switches']} switches" if state else "-"
        print(f"| {capacity:,} | " + " | ".join(cells) + f" | {end} |", flush=True)


if __name__ == "__main__":
    main()
