"""Benchmark of CUDA regions: device -> L2 (store_pages) and L2 -> device (load_pages) through a real
daemon and its CUDA copy executor, against a raw torch copy of the same number of bytes between the same
device tensor and pinned host memory (a memfd mapping pinned in place, as the daemon pins its pool), timed
in the same repetition, for 64 KiB, 2 MiB and 16 MiB pages, contiguous and segmented; with the engine-side
time of each store_pages / load_pages call. Without CUDA it says so and exits 0.
Usage: python bench/bench_gpu.py [--quick] [--budget-s S] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20
PIN_CHUNK = 64 << 30
TARGET = 0.8  # hicached's GB/s over the raw copy's
MIN_REPS = 2  # measured repetitions a case keeps however short the budget
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


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def p99(values: list[float]) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def calls(samples: list[tuple[float, int]]) -> dict[str, float]:
    """Engine-side time of the store_pages / load_pages calls: (seconds, pages) each."""
    per_call = [t for t, _ in samples]
    per_page = [t / k for t, k in samples]
    return {
        "calls": len(samples),
        "call_median_ms": statistics.median(per_call) * 1e3,
        "call_p99_ms": p99(per_call) * 1e3,
        "page_median_us": statistics.median(per_page) * 1e6,
        "page_p99_us": p99(per_page) * 1e6,
    }


def bench(c, host: torch.Tensor, page: int, name: str, segs, a: argparse.Namespace, until: float) -> dict:
    """One page size and layout: repetitions until `until` (at least MIN_REPS, at most a.reps), each timing
    hicached's store and load of every page and, right after, the raw copies of the same bytes."""
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
    store_calls: list[tuple[float, int]] = []
    load_calls: list[tuple[float, int]] = []
    rep = 0
    # The first repetition warms up (pinning, IPC, allocator, staging) and is dropped.
    while rep <= MIN_REPS or (rep <= a.reps and now() < until):
        rng.shuffle(order)
        keys = [f"{page:08x}{rep:08x}{i:048x}" for i in range(n)]
        sc: list[tuple[float, int]] = []
        lc: list[tuple[float, int]] = []
        t0 = now()
        for i in range(0, n, batch):
            t1 = now()
            ok = c.store_pages(hs, order[i : i + batch], keys[i : i + batch])
            sc.append((now() - t1, len(ok)))
            assert all(ok), f"store_pages refused {ok.count(False)} of {len(ok)} pages"
        t_store = now() - t0
        back = order[::-1]
        t0 = now()
        for i in range(0, n, batch):
            want = len(keys[i : i + batch])
            t1 = now()
            got = c.load_pages(hd, back[i : i + batch], keys[i : i + batch])
            lc.append((now() - t1, want))
            assert got == want, f"load_pages loaded {got} of {want} pages"
        t_load = now() - t0
        nbytes = n * page
        d2h = raw_copy(host[:nbytes], src[:nbytes])
        h2d = raw_copy(dst[:nbytes], host[:nbytes])
        if rep:
            for k, v in (("store", t_store), ("load", t_load), ("d2h", d2h), ("h2d", h2d)):
                t[k].append(v)
            store_calls += sc
            load_calls += lc
        rep += 1
    # The raw H2D above overwrote dst: check the daemon's bytes with one more load.
    assert c.load_pages(hd, back[:batch], keys[:batch]) == batch
    s_cpu, d_cpu = src.cpu(), dst.cpu()
    for i in random.Random(2).sample(range(min(n, batch)), min(4, batch)):
        j = back[i]
        for off, ln, st in seg_list:
            p = order[i]
            assert torch.equal(
                s_cpu[off + p * st : off + p * st + ln], d_cpu[off + j * st : off + j * st + ln]
            ), f"page {p} loaded into {j} differs from what was stored"
    c.unregister_region(hs)
    c.unregister_region(hd)
    gb = n * page / 1e9
    g = {k: spread([gb / x for x in v]) for k, v in t.items()}
    case = {
        "page_bytes": page,
        "layout": name,
        "segments": len(seg_list),
        "pages": n,
        "pages_per_call": batch,
        "reps": len(t["store"]),
        "store_gbps": g["store"],
        "raw_d2h_gbps": g["d2h"],
        "store_ratio": g["store"]["median"] / g["d2h"]["median"],
        "load_gbps": g["load"],
        "raw_h2d_gbps": g["h2d"],
        "load_ratio": g["load"]["median"] / g["h2d"]["median"],
        "store_calls": calls(store_calls),
        "load_calls": calls(load_calls),
    }
    label = f"{page >> 10} KiB, {name}"
    for op, raw in (("store", "d2h"), ("load", "h2d")):
        s, r, cl = g[op], g[raw], case[f"{op}_calls"]
        print(
            f"  {label:28} {op:5} {s['median']:6.2f} GB/s ({s['min']:.2f}-{s['max']:.2f}), raw "
            f"{raw.upper()} {r['median']:6.2f} ({r['min']:.2f}-{r['max']:.2f}), {case[op + '_ratio']:.2f}x; "
            f"call {cl['call_median_ms']:.2f} ms (p99 {cl['call_p99_ms']:.2f}), "
            f"{cl['page_median_us']:.1f} us/page"
        )
    return case


def rows_of(cases: list[dict]) -> list[Row]:
    rows: list[Row] = []
    for k in cases:
        label = f"{k['page_bytes'] >> 10} KiB, {k['layout']}"
        for name, op, raw in (("device -> L2", "store", "d2h"), ("L2 -> device", "load", "h2d")):
            val, base = k[f"{op}_gbps"]["median"], k[f"raw_{raw}_gbps"]["median"]
            rows.append((f"{name}, {label}", val, base, f">={TARGET}"))
    return rows


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
        "commit": commit(),
    }
    if env["cuda"]:
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_memory_gib"] = round(props.total_memory / (1 << 30), 1)
    return env


def write_json(path: str | None, doc: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller and fewer repetitions")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"time for the whole run: repetitions stop early (never below {MIN_REPS} a case) and cases "
        "that no longer fit are skipped and listed",
    )
    parser.add_argument("--json", help="write the environment and every figure here too")
    a = parser.parse_args()
    env = environment()
    if not env["cuda"]:
        why = (
            "CUDA is not available on this machine (torch.cuda.is_available() is False); it needs a GPU and "
            "a CUDA build of torch. Nothing was measured."
        )
        print(f"bench_gpu: {why}")
        write_json(a.json, {"environment": env, "cuda": False, "reason": why, "cases": []})
        return 0
    from bench_regions import COPY_THREADS, Daemon, layouts, print_table

    from hicached import Client

    sizes = (64 * 1024, 2 * MiB, 16 * MiB)
    a.rep_bytes, a.reps = (128 * MiB, 3) if a.quick else (512 * MiB, 7)
    a.batch_bytes = 64 * MiB
    print(
        f"hicached bench_gpu: python {env['python']}, torch {env['torch']} (CUDA {env['torch_cuda']}), "
        f"{env['gpu']} x{env['gpu_count']}, commit {env['commit']}"
    )
    print(
        f"daemon: no L3, pool {2 * a.rep_bytes >> 20} MiB pinned by the daemon, {COPY_THREADS} copy threads; "
        f"{a.rep_bytes >> 20} MiB per repetition, requests of up to {a.batch_bytes >> 20} MiB, pages in "
        "shuffled order; raw: one torch copy of the same bytes between the device tensor and pinned host "
        "memory (a memfd pinned in place), right after hicached's in each repetition"
    )
    started = now()
    deadline = started + a.budget_s if a.budget_s else math.inf
    todo = [(page, name) for page in sizes for name in layouts(page, a.rep_bytes // page)]
    cases: list[dict] = []
    skipped: list[str] = []
    errors: list[str] = []

    def save() -> None:
        """The JSON as it stands: written after each case too, so that a run stopped midway leaves it."""
        rows = rows_of(cases)
        config = {"rep_bytes": a.rep_bytes, "batch_bytes": a.batch_bytes, "max_reps": a.reps}
        config.update(min_reps=MIN_REPS, copy_threads=COPY_THREADS, pool_bytes=2 * a.rep_bytes)
        doc = {"environment": env, "cuda": True, "config": config, "budget_s": a.budget_s}
        doc.update(target_ratio=TARGET, cases=cases, skipped=skipped, errors=errors)
        doc["rows"] = [
            {"figure": n, "gbps": v, "raw_gbps": r, "ratio": v / r, "pass": v / r >= TARGET}
            for n, v, r, _ in rows
        ]
        doc["seconds"] = now() - started
        write_json(a.json, doc)

    work = Path(tempfile.mkdtemp(prefix="hicached-bench-gpu-"))
    try:
        for page in sizes:
            mine = [name for p, name in todo if p == page]
            if now() >= deadline:
                skipped += [f"{page >> 10} KiB, {name}: out of the time budget" for name in mine]
                continue
            d = None
            try:
                d = Daemon(work, 2 * a.rep_bytes)
                with d, Client(d.sock, f"gpu.p{page}", page) as c:
                    host, ptrs = pinned(a.rep_bytes)
                    try:
                        for name, segs in layouts(page, a.rep_bytes // page).items():
                            if now() >= deadline:
                                skipped.append(f"{page >> 10} KiB, {name}: out of the time budget")
                                continue
                            share = (deadline - now()) / (len(todo) - todo.index((page, name)))
                            cases.append(bench(c, host, page, name, segs, a, now() + share))
                            save()
                    finally:
                        for ptr in ptrs:
                            torch.cuda.cudart().cudaHostUnregister(ptr)
                        del host
            except Exception as e:
                done = {(k["page_bytes"], k["layout"]) for k in cases}
                lost = [name for name in mine if (page, name) not in done]
                log = d.log_path.read_text(errors="replace")[-2000:] if d and d.log_path.exists() else ""
                errors.append(
                    f"{page >> 10} KiB ({', '.join(lost)}): {type(e).__name__}: {e}\n"
                    + "".join(traceback.format_exception(e)[-3:])
                    + (f"daemon log, end:\n{log}" if log else "")
                )
                print(f"  {page >> 10} KiB: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        rows = rows_of(cases)
        if rows:
            print_table(rows)
        print(f"\nGB = 1e9 bytes; min-max and medians of up to {a.reps} repetitions; {now() - started:.0f} s")
        for s in skipped:
            print(f"skipped: {s}")
        for e in errors:
            print(f"error: {e}")
        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
