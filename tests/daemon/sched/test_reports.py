"""EveryMinute alone, on a patched clock: counted always, logged at once, then at most once a minute."""

from __future__ import annotations

import collections
import logging

from hicached.daemon.sched import reports as reports_mod
from hicached.daemon.sched.reports import LOG_INTERVAL_S, EveryMinute


class Clock:
    """time as the reports module sees it: monotonic() is what the test set."""

    now = 1000.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


def test_logged_at_once_then_at_most_once_a_minute_with_the_count_since(monkeypatch, caplog):
    monkeypatch.setattr(reports_mod, "time", Clock)
    monkeypatch.setattr(Clock, "now", 1000.0)
    caplog.set_level(logging.WARNING, logger="hicached.tiers")
    counters: collections.Counter[str] = collections.Counter()
    report = EveryMinute(counters, "things.bad", logging.WARNING, "%d bad things since %s; %d in all")
    assert "things.bad" in counters and counters["things.bad"] == 0  # the metric exists before the first
    report.add(2)
    Clock.now += LOG_INTERVAL_S / 2
    report.add(3)
    Clock.now += LOG_INTERVAL_S / 2 - 0.001
    report.add(1)  # still within the minute
    assert counters["things.bad"] == 6
    assert [r.getMessage() for r in caplog.records] == ["2 bad things since start; 2 in all"]
    Clock.now += 0.001
    report.add(4)
    Clock.now += LOG_INTERVAL_S
    report.add(1, "%d other things since %s; %d in all")  # a message of the call's own
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "2 bad things since start; 2 in all"),
        (logging.WARNING, "8 bad things since the last report; 10 in all"),
        (logging.WARNING, "1 other things since the last report; 11 in all"),
    ]
    assert counters["things.bad"] == 11


def test_the_level_is_the_reports_own(monkeypatch, caplog):
    monkeypatch.setattr(reports_mod, "time", Clock)
    monkeypatch.setattr(Clock, "now", 5.0)
    caplog.set_level(logging.DEBUG, logger="hicached.tiers")
    counters: collections.Counter[str] = collections.Counter({"lost": 7})
    report = EveryMinute(counters, "lost", logging.ERROR)
    assert counters["lost"] == 7  # counted on from what is there
    report.add(1)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.ERROR, "8 start 8")]
