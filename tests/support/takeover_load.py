"""steady_load's engine traffic with an engine that reconnects: a call whose connection dropped is sent again
on a new Client, as an engine does across a takeover.

    python -m takeover_load SOCKET NAMESPACE PAGE_BYTES SECONDS OUT [PERIOD_S] [BATCH]

OUT receives one JSON object a line, as steady_load writes them, plus "drops": how many times the call's
connection dropped before it was answered, and "error": the code of a call that failed otherwise (or that
could not reconnect: "unreachable")."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from churn import page_of

from hicached import Client, HicachedError

RECONNECT_S = 60.0  # how long an engine keeps trying to reach the daemon after a drop


class Engine:
    def __init__(self, socket: str, namespace: str, page_bytes: int) -> None:
        self.args = (socket, namespace, page_bytes)
        self.client = Client(*self.args, timeout=60)

    def call(self, fn: Callable[[Client], Any], record: dict) -> Any:
        """fn(client), sent again on a new connection each time the connection drops."""
        while True:
            try:
                return fn(self.client)
            except HicachedError as e:
                if e.code != "connection":
                    raise
                record["drops"] = record.get("drops", 0) + 1
                self.client.close()
                self.client = self._reconnect(record)

    def _reconnect(self, record: dict) -> Client:
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                return Client(*self.args, timeout=60)
            except HicachedError as e:
                # A connection refused or a missing path: the socket was unreachable. A drop in the handshake
                # (an instance handing over) is one more reconnect.
                if "no hicached daemon is listening" in str(e):
                    record.setdefault("unreachable", []).append(str(e))
                if time.monotonic() > deadline:
                    raise HicachedError("unreachable", f"no daemon within {RECONNECT_S}s: {e}") from None
                time.sleep(0.01)


def run(
    socket: str, namespace: str, page_bytes: int, seconds: float, period: float, batch: int
) -> list[dict]:
    calls: list[dict] = []
    prefix = f"p{time.time_ns()}"
    buffers = [bytearray(page_bytes) for _ in range(batch)]
    deadline = time.monotonic() + seconds
    n = 0
    previous: list[str] = []
    engine = Engine(socket, namespace, page_bytes)
    while time.monotonic() < deadline:
        tick = time.monotonic()
        keys = [f"{prefix}-{n + i}" for i in range(batch)]
        n += batch
        call: dict = {"op": "store", "t": time.time(), "n": batch}
        start = time.perf_counter()
        try:
            pages = [page_of(k, page_bytes) for k in keys]
            ok = engine.call(lambda c, keys=keys, pages=pages: c.store(keys, pages), call)
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
                bufs = buffers[: len(previous)]
                got = engine.call(lambda c, keys=previous, bufs=bufs: c.load(keys, bufs), call)
                call["ok"] = got
                call["wrong"] = sum(bytes(buffers[i]) != page_of(previous[i], page_bytes) for i in range(got))
            except HicachedError as e:
                call["ok"], call["error"] = 0, e.code
            call["s"] = time.perf_counter() - start
            calls.append(call)
        previous = keys
        time.sleep(max(0.0, period - (time.monotonic() - tick)))
    engine.client.close()
    return calls


def main(argv: list[str]) -> int:
    socket, namespace, page_bytes, seconds, out, *rest = argv
    period = float(rest[0]) if rest else 0.02
    batch = int(rest[1]) if len(rest) > 1 else 4
    calls = run(socket, namespace, int(page_bytes), float(seconds), period, batch)
    with open(out, "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in calls)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
