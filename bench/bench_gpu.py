"""Benchmark of CUDA regions: device -> L2 (store_pages) and L2 -> device (load_pages) through a real
daemon and its CUDA copy executor, against a raw torch copy of the same number of bytes between the same
device tensor and pinned host memory (a memfd mapping pinned in place, as the daemon pins its pool), for
64 KiB, 2 MiB and 16 MiB pages, contiguous and segmented. Without CUDA it says so and exits 0.
Usage: python bench/bench_gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

MiB = 1 << 20
PIN_CHUNK = 64 << 30
now = time.perf_counter
Row = tuple[str, float, float, str]


def pinned(nbytes: int) -> tuple[torch.Tensor, list[int]]:
    """Host memory for the raw copies: a prefaulted memfd mapping pinned in place (cudaHostRegister), as the
    daemon pins its pool; not the pool itself, whose slots hold the pages being measured."""
    from hicached import shared_buffer

    host = shared_buffer(nbytes)
    cudart = torch.cuda.cudart()
    ptrs = []
    for off in range(0, nbytes, PIN_CHUNK):
        n = min(PIN_CHUNK, nbytes - off)
        torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr() + off, n, 1))
        ptrs.append(host.data_ptr() + off)
    return host, ptrs


def raw_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = now()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return now() - t0


def bench(c, host: torch.Tensor, page: int, name: str, segs, a: argparse.Namespace) -> list[Row]:
    from hicached.common.geometry import Geometry, Segment

    n = a.rep_bytes // page
    batch = max(1, min(n, a.batch_bytes // page))
    seg_list = segs or [(0, page, page)]
    geom = Geometry(page, n, tuple(Segment(*s) for s in seg_list))
    src = torch.randint(0, 256, (geom.extent,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()  # the daemon's stream does not wait on ours: the pages must be written
    hs = c.register_region(src, page, segments=segs, num_pages=n)
    hd = c.register_region(dst, page, segments=segs, num_pages=n)
    order = list(range(n))
    rng = random.Random(page)
    t: dict[str, list[float]] = {k: [] for k in ("store", "load", "d2h", "h2d")}
    for rep in range(a.reps + 1):  # the first repetition warms up (pinning, IPC, allocator) and is dropped
        rng.shuffle(order)
        keys = [f"{page:08x}{rep:08x}{i:048x}" for i in range(n)]
        t0 = now()
        for i in range(0, n, batch):
            assert all(c.store_pages(hs, order[i : i + batch], keys[i : i + batch]))
        t_store = now() - t0
        back = order[::-1]
        t0 = now()
        for i in range(0, n, batch):
            assert c.load_pages(hd, back[i : i + batch], keys[i : i + batch]) == len(keys[i : i + batch])
        t_load = now() - t0
        nbytes = n * page
        d2h = raw_copy(host[:nbytes], src[:nbytes])
        h2d = raw_copy(dst[:nbytes], host[:nbytes])
        if rep:
            for k, v in (("store", t_store), ("load", t_load), ("d2h", d2h), ("h2d", h2d)):
                t[k].append(v)
    # The raw H2D above overwrote dst: check the daemon's bytes with one more load.
    assert c.load_pages(hd, back[:batch], keys[:batch]) == batch
    s_cpu, d_cpu = src.cpu(), dst.cpu()
    for i in random.Random(2).sample(range(min(n, batch)), min(4, batch)):
        j = back[i]
        for off, ln, st in seg_list:
            p = order[i]
            assert torch.equal(
                s_cpu[off + p * st : off + p * st + ln], d_cpu[off + j * st : off + j * st + ln]
            )
    c.unregister_region(hs)
    c.unregister_region(hd)
    gb = n * page / 1e9
    g = {k: gb / statistics.median(v) for k, v in t.items()}
    label = f"{page >> 10} KiB, {name}"
    print(
        f"  {label:30} store {g['store']:6.2f} GB/s (raw D2H {g['d2h']:6.2f})   "
        f"load {g['load']:6.2f} GB/s (raw H2D {g['h2d']:6.2f})"
    )
    return [
        (f"device -> L2, {label}", g["store"], g["d2h"], ">=0.8"),
        (f"L2 -> device, {label}", g["load"], g["h2d"], ">=0.8"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller and fewer repetitions")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_gpu: CUDA is not available on this machine (torch.cuda.is_available() is False); "
            "it needs a GPU and a CUDA build of torch. Nothing was measured."
        )
        return 0
    from bench_regions import Daemon, layouts, print_table

    from hicached import Client

    a.sizes = (64 * 1024, 2 * MiB, 16 * MiB)
    a.rep_bytes, a.reps = (128 * MiB, 3) if a.quick else (512 * MiB, 7)
    a.batch_bytes = 64 * MiB
    props = torch.cuda.get_device_properties(0)
    print(f"hicached bench_gpu: python {platform.python_version()}, torch {torch.__version__}, {props.name}")
    print(
        f"daemon: no L3, pool {2 * a.rep_bytes >> 20} MiB pinned by the daemon; {a.rep_bytes >> 20} MiB per "
        f"repetition, requests of up to {a.batch_bytes >> 20} MiB, pages in shuffled order; raw: one torch "
        "copy of the same bytes between the device tensor and pinned host memory (a memfd pinned in place)"
    )
    work = Path(tempfile.mkdtemp(prefix="hicached-bench-gpu-"))
    started = now()
    rows: list[Row] = []
    try:
        for page in a.sizes:
            with Daemon(work, 2 * a.rep_bytes) as d, Client(d.sock, f"gpu.p{page}", page) as c:
                host, ptrs = pinned(a.rep_bytes)
                try:
                    for name, segs in layouts(page, a.rep_bytes // page).items():
                        rows += bench(c, host, page, name, segs, a)
                finally:
                    for ptr in ptrs:
                        torch.cuda.cudart().cudaHostUnregister(ptr)
                    del host
        print_table(rows)
        print(f"\nGB = 1e9 bytes; medians of {a.reps} repetitions; whole run {now() - started:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
