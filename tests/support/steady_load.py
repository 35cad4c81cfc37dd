"""An engine's steady traffic, in a process of its own, for tests and benchmarks of L3 faults: every PERIOD it
stores a batch of new pages and loads back the batch it stored before, and writes what each call did.

    python -m steady_load SOCKET NAMESPACE PAGE_BYTES SECONDS OUT [PERIOD_S] [BATCH] [UNTIL_RECONNECTS]

OUT receives one JSON object a line: {"op": "store"|"load", "t": wall-clock start, "s": seconds taken,
"ok": pages stored or loaded, "n": pages asked for, "wrong": pages loaded holding other bytes, "keys": the
keys acknowledged (stores), "error": the error code of a call that raised}, and last {"op": "end",
"reconnects": how often the client dialled the daemon again}. With UNTIL_RECONNECTS, it stops one store and
load after the client has reconnected that often (a restart under load, and no more load after it). Page
bytes follow from keys (churn.page_of)."""

from __future__ import annotations

import json
import sys
import time

from churn import page_of

from hicached import Client, HicachedError


def run(
    socket: str, namespace: str, page_bytes: int, seconds: float, period: float, batch: int, until: int = 0
) -> list[dict]:
    calls: list[dict] = []
    prefix = f"p{time.time_ns()}"
    buffers = [bytearray(page_bytes) for _ in range(batch)]
    deadline = time.monotonic() + seconds
    n = 0
    previous: list[str] = []
    with Client(socket, namespace, page_bytes, timeout=60) as c:
        last = False
        while time.monotonic() < deadline and not last:
            last = bool(until) and c.reconnects >= until
            tick = time.monotonic()
            keys = [f"{prefix}-{n + i}" for i in range(batch)]
            n += batch
            call: dict = {"op": "store", "t": time.time(), "n": batch}
            start = time.perf_counter()
            try:
                ok = c.store(keys, [page_of(k, page_bytes) for k in keys])
                call["ok"] = sum(ok)
                call["keys"] = [k for k, good in zip(keys, ok, strict=True) if good]
            except HicachedError as e:
                call["ok"], call["error"] = 0, e.code
            call["s"] = time.perf_counter() - start
            calls.append(call)
            if previous:
                call = {"op": "load", "t": time.time(), "n": len(previous)}
                start = time.perf_counter()
                try:
                    got = c.load(previous, buffers[: len(previous)])
                    call["ok"] = got
                    call["wrong"] = sum(
                        bytes(buffers[i]) != page_of(previous[i], page_bytes) for i in range(got)
                    )
                except HicachedError as e:
                    call["ok"], call["error"] = 0, e.code
                call["s"] = time.perf_counter() - start
                calls.append(call)
            previous = keys
            time.sleep(max(0.0, period - (time.monotonic() - tick)))
        calls.append({"op": "end", "reconnects": c.reconnects})
    return calls


def main(argv: list[str]) -> int:
    socket, namespace, page_bytes, seconds, out, *rest = argv
    period = float(rest[0]) if rest else 0.02
    batch = int(rest[1]) if len(rest) > 1 else 4
    until = int(rest[2]) if len(rest) > 2 else 0
    calls = run(socket, namespace, int(page_bytes), float(seconds), period, batch, until)
    with open(out, "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in calls)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
