"""Is this machine calm enough to benchmark? Two figures that move with a shared VM's phase and not with
hicached: the round trip of a 16-byte ping-pong between two processes over a socketpair (median, 90th
and 99th percentiles of 3000, with short pauses that let the peer's CPU go idle as between store calls),
and the time of a bare Python loop of 2 M additions.

Usage: python bench/guest_probe.py

On the 2-vCPU guest of bench/RESULTS.md, calm reads ~10-20 us / ~100 us at the 99th percentile and
~250-350 ms for the loop; noisy, a 99th percentile of 1-5 ms and loops of 400-1100 ms. Rows that hand
work between the client and the daemon many times a second (the 256 KiB stores) follow the first figure.
"""

from __future__ import annotations

import os
import socket
import time


def ping_pong(n: int = 3000) -> list[float]:
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echoing peer
        a.close()
        while data := b.recv(64):
            b.send(data)
        os._exit(0)
    b.close()
    times = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            a.send(b"x" * 16)
            a.recv(64)
            times.append(time.perf_counter() - t0)
            if i % 10 == 0:
                time.sleep(0.0005)
    finally:
        a.close()
        os.waitpid(pid, 0)
    return sorted(times)


def python_loop() -> float:
    t0 = time.perf_counter()
    s = 0
    for i in range(2_000_000):
        s += i
    return time.perf_counter() - t0


def main() -> None:
    rt = ping_pong()

    def q(f: float) -> float:
        return rt[int(f * (len(rt) - 1))] * 1e6

    loop = python_loop()
    print(
        f"{time.strftime('%H:%M:%S')} ping-pong p50 {q(0.5):.0f} us, p90 {q(0.9):.0f} us, "
        f"p99 {q(0.99):.0f} us; Python loop {loop * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
