"""Writes a synthetic prefix-cache trace in Mooncake's FAST'25 format (JSON lines of `timestamp` in ms,
`input_length`, `output_length`, `hash_ids`: one id per 512-token block, equal ids for an equal prefix up
to and including that block), seeded, for bench/bench_trace.py's smoke runs. Its traffic has the shapes of
prefix traffic: shared system prompts (a few popular, many rare), multi-turn conversations (each turn the
previous prompt, its answer and a new message) and long documents asked several questions.

Usage: python bench/make_trace.py OUT.jsonl [--requests 400] [--seed 1] [--rate 8]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from dataclasses import dataclass

BLOCK_TOKENS = 512

Segment = tuple[int, int]  # (segment id, tokens): a piece of text, equal ids for equal text


@dataclass
class _Ids:
    """Chain ids: a block's id stands for its parent's id and the pieces of text it holds."""

    table: dict[tuple, int]

    def blocks(self, content: list[Segment]) -> list[int]:
        out: list[int] = []
        pieces: list[tuple[int, int, int]] = []  # (segment, from, to) within the current block
        room = BLOCK_TOKENS
        for seg, n in content:
            at = 0
            while at < n:
                take = min(room, n - at)
                pieces.append((seg, at, at + take))
                at += take
                room -= take
                if room == 0:
                    out.append(self._id(out, pieces))
                    pieces, room = [], BLOCK_TOKENS
        if pieces:
            out.append(self._id(out, pieces))
        return out

    def _id(self, out: list[int], pieces: list[tuple[int, int, int]]) -> int:
        key = (out[-1] if out else -1, tuple(pieces))
        return self.table.setdefault(key, len(self.table))


def make_trace(
    requests: int = 400,
    seed: int = 1,
    rate: float = 8.0,
    system_prompts: int = 6,
    doc_share: float = 0.25,
    turns_mean: float = 3.0,
    questions_mean: float = 3.0,
) -> list[dict]:
    """`requests` requests arriving as conversations and document readings start (Poisson, `rate` a
    second) and go on (each next turn or question after a pause); sorted by arrival."""
    rng = random.Random(seed)
    segs = iter(range(1 << 62))
    systems = [(next(segs), rng.randint(300, 3000)) for _ in range(system_prompts)]
    popularity = [1 / (i + 1) for i in range(system_prompts)]  # Zipf-like: the first prompts dominate
    ids = _Ids({})
    queue: list[tuple[float, int, list[Segment], int, str]] = []  # (time, tie, content, turns left, kind)
    out: list[dict] = []
    t = 0.0
    tie = 0
    while len(out) < requests:
        t += rng.expovariate(rate)
        tie += 1
        if rng.random() < doc_share:
            doc = (next(segs), rng.randint(4000, 30000))
            turns = 1 + int(rng.expovariate(1 / max(questions_mean - 1, 1e-9)))
            heapq.heappush(queue, (t, tie, [doc], turns, "doc"))
        else:
            system = rng.choices(systems, popularity)[0]
            turns = 1 + int(rng.expovariate(1 / max(turns_mean - 1, 1e-9)))
            heapq.heappush(queue, (t, tie, [system], turns, "chat"))
        # Everything due before the next start is served first.
        while queue and queue[0][0] <= t:
            when, _, content, turns, kind = heapq.heappop(queue)
            asked = rng.randint(20, 300) if kind == "doc" else rng.randint(30, 1500)
            prompt = [*content, (next(segs), asked)]
            output = rng.randint(10, 800)
            tokens = sum(n for _, n in prompt)
            out.append(
                {
                    "timestamp": int(when * 1000),
                    "input_length": tokens,
                    "output_length": output,
                    "hash_ids": ids.blocks(prompt),
                }
            )
            if len(out) >= requests:
                break
            if turns > 1:
                tie += 1
                pause = rng.expovariate(1 / 10.0)  # seconds until the next turn or question
                # A conversation goes on from its whole history; a document's next question from the document.
                nxt = [*prompt, (next(segs), output)] if kind == "chat" else content
                heapq.heappush(queue, (when + pause, tie, nxt, turns - 1, kind))
    out.sort(key=lambda r: r["timestamp"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the trace file to write (JSON lines); - for stdout")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rate", type=float, default=8.0, help="conversations and documents started a second")
    p.add_argument("--system-prompts", type=int, default=6)
    p.add_argument("--doc-share", type=float, default=0.25, help="share of starts that are documents")
    a = p.parse_args()
    trace = make_trace(a.requests, a.seed, a.rate, a.system_prompts, a.doc_share)
    text = "".join(json.dumps(r) + "\n" for r in trace)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
