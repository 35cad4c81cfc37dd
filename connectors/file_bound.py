"""The file backend's capacity bound (storage.file.max_bytes): the estimate of the bytes stored, the janitor
task that has file_janitor scan the tree on its own thread and remove pages past the bound, and the task
that shares the estimate with the other daemons on the same root (file_fleet), whose janitors take turns."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time

from . import file_fleet, file_janitor

log = logging.getLogger("hicached.connectors.file")

_SKIPPED = "skipped"  # another daemon's janitor holds the lease: this run was left to it


@dataclasses.dataclass(frozen=True)
class _Run:
    total: int  # bytes of the page files the scan found
    evicted: int  # pages this run removed
    freed: int  # and their bytes
    gone: int  # pages removed by someone else between the scan and this run's turn to remove them
    gone_bytes: int
    stale: int  # temporary files of a crash removed
    trash: int  # trees of unfinished clears removed
    coordinated: bool  # under the lease (or no bound: nothing to share)


class Bound:
    """Methods of FileConnector (file.py holds the state): the bytes it stores, and the janitor."""

    def _add_stored(self, nbytes: int) -> None:
        self._ledger.add(nbytes)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the page files under root, headers included, every daemon's on this root: exact after a
        scan, estimated between (this daemon's changes at once, the others' at each fleet_refresh)."""
        return self._ledger.estimate

    def _bound_info(self) -> dict:
        return {
            "max_bytes": self._max_bytes,
            "low_bytes": self._low_bytes,
            "coordinated": not self._lock_unsupported,  # janitors take turns (flock works on this root)
            **self._ledger.info(),
        }

    async def enforce_bound(self) -> int:
        """Scans the tree (on the janitor thread): counts the bytes stored, removes temporary files and
        trees of cleared namespaces left by a crash, and when over `max_bytes` removes the least recently
        used pages down to the low watermark. With a bound, only while this daemon holds the janitor's
        lease on the root: where another daemon's janitor runs, this one does nothing (`_skipped`). Returns
        how many pages it removed."""
        async with self._enforcing:
            loop = asyncio.get_running_loop()
            done = await loop.run_in_executor(self._scan_executor, self._enforce, self._stop)
            self._scanned.set()
            self._skipped = done == _SKIPPED
            if done is None:  # stopped by close()
                return 0
            if done == _SKIPPED:
                self.counters["janitor.skipped_locked"] += 1
                return 0
            if self._max_bytes:  # runs of the bound's janitor (without one, only the scan at start)
                self.counters["janitor.runs"] += 1
            if not done.coordinated:
                self.counters["janitor.lock_unsupported"] += 1
                if not self._lock_unsupported:
                    log.warning(
                        "file: %s cannot be locked (flock); the janitors of the daemons sharing it run each "
                        "on its own. Together they still remove no more than the excess, but each scans the "
                        "whole tree; on NFS mount with locks (not `nolock`), on Lustre with `-o flock`",
                        self.root,
                    )
                self._lock_unsupported = True
            self._last_scan_total = done.total
            self.counters["evictions"] += done.evicted
            self.counters["evicted_bytes"] += done.freed
            self.counters["evicted_gone"] += done.gone
            self.counters["stale_temp_removed"] += done.stale
            self.counters["stale_trash_removed"] += done.trash
            if done.evicted or done.gone:
                log.info(
                    "file: %s was over its bound of %d bytes (%d); removed %d least recently used pages, %d "
                    "bytes (%d more were removed meanwhile by others)",
                    self.root,
                    self._max_bytes,
                    done.total,
                    done.evicted,
                    done.freed,
                    done.gone,
                )
            if done.stale:
                log.info("file: removed %d temporary files left by an earlier crash", done.stale)
            if done.trash:
                log.info("file: removed %d namespace trees left by clears that did not finish", done.trash)
            return done.evicted

    async def _janitor_loop(self) -> None:
        failing = False
        while True:
            try:
                evicted = await self.enforce_bound()
            except Exception as e:
                if not failing:  # once, not every interval: it is tried again until it works
                    log.warning(
                        "file: the janitor cannot scan %s (%r); trying again every %ss",
                        self.root,
                        e,
                        self._janitor_interval,
                    )
                failing = True
            else:
                if failing:
                    log.info("file: the janitor scans %s again", self.root)
                failing = False
            due = None if failing else self._leftovers_due
            if not self._max_bytes:
                if due is None:
                    return  # no bound: the first scan (the count, crash leftovers) is all there is to do
                # Temporary files of a crash too young to remove yet: scan again once they are stale.
                await asyncio.sleep(max(0.0, due - time.time()))
                continue
            if failing or (not self._skipped and not evicted and self._last_scan_total > self._max_bytes):
                # Over, yet nothing could be removed: wait an interval rather than scan again on every put.
                await asyncio.sleep(self._janitor_interval)
                continue
            if self._skipped:
                # Another daemon's janitor runs now: its scan reaches the estimate at a refresh. Until one
                # does (a long scan; or it died, and its lease with it), try the lease again each refresh.
                seen = self._ledger.scan_seq
                await self._next_refresh()
                if self._ledger.scan_seq == seen:
                    continue
            elif self.stored_bytes > self._max_bytes >= self._last_scan_total:
                # The tree was within the bound and the estimate is not (pages came in since the scan, or
                # the others' ledgers still count what it saw): look again after the next refresh.
                await self._next_refresh()
            # Under the bound: wait for a put or a refresh that crosses it, looking at the estimate every
            # interval too, or for crash leftovers to turn stale. Still over after removing pages: new pages
            # came in meanwhile, so go again at once.
            while self.stored_bytes <= self._max_bytes:
                wait = self._janitor_interval
                if due is not None:
                    if time.time() >= due:
                        break
                    wait = min(wait, due - time.time())
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()

    async def _next_refresh(self) -> None:
        self._refreshed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._janitor_interval):
                await self._refreshed.wait()

    async def _fleet_loop(self) -> None:
        """Every fleet_refresh: publishes this daemon's count, reads the others' and the last scan, and wakes
        the janitor when the estimate passes the bound."""
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            try:
                await loop.run_in_executor(self._fleet_executor, self._ledger.refresh)
            except Exception as e:
                self.counters["fleet.errors"] += 1
                if not failing:  # once: tried again every period until it works
                    log.warning(
                        "file: cannot share the bound's count under %s/%s (%r): the other daemons see this "
                        "one's writes at their next scan only; trying again every %ss",
                        self.root,
                        file_janitor.FLEET_DIR,
                        e,
                        self._fleet_refresh,
                    )
                failing = True
            else:
                if failing:
                    log.info("file: the bound's count is shared under %s again", self.root)
                failing = False
            self._refreshed.set()
            if self.stored_bytes > self._max_bytes:
                self._wake.set()
            await asyncio.sleep(self._fleet_refresh)

    async def _close_fleet(self) -> None:
        """Stops the refreshes, and publishes this daemon's last count: the others' estimates keep what it
        wrote (a reload swaps in a connector with a ledger of its own). A hung store is not waited for."""
        if self._refresher is None:
            return
        self._refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._refresher
        last = asyncio.get_running_loop().run_in_executor(self._fleet_executor, self._ledger.publish)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await last

    # The janitor's side, run on its own thread.

    def _enforce(self, stop: threading.Event) -> _Run | str | None:
        """One janitor run (_Run), _SKIPPED where another daemon's holds the lease; None if stopped."""
        if not self._max_bytes:
            return self._run(stop, coordinated=True)
        with file_fleet.lease(self.root) as held:
            if held == file_fleet.TAKEN:
                return _SKIPPED
            return self._run(stop, coordinated=held == file_fleet.HELD)

    def _run(self, stop: threading.Event, coordinated: bool) -> _Run | None:
        snapshot = self._ledger.begin_run()
        trash = file_janitor.remove_trash(self.root, self._clearing, stop)
        scanned = file_janitor.scan(
            self.root,
            stop,
            collect=self._max_bytes > 0,
            own_tag=self._tmp_tag,
            clearing=self._clearing,
        )
        if scanned is None:
            return None
        total, pages, stale, self._leftovers_due = scanned
        # This daemon's bound, whatever the others' (one may have reloaded a new max_bytes before another).
        max_bytes, low = self._max_bytes, self._low_bytes
        evicted = freed = gone = gone_bytes = 0
        if max_bytes and total > max_bytes:
            pages.sort()
            for used, size, ino, path in pages:
                if total - freed - gone_bytes <= low or stop.is_set():
                    break
                outcome = file_janitor.evict(path, ino, used)
                if outcome == file_janitor.REMOVED:
                    evicted += 1
                    freed += size
                elif outcome == file_janitor.GONE:
                    gone += 1
                    gone_bytes += size
        unshared = self._ledger.end_run(total - freed - gone_bytes, snapshot, max_bytes)
        if unshared is not None and not self._scan_unshared:  # once: its figures still hold here
            log.warning(
                "file: the janitor's scan of %s could not be shared (%s); the other daemons go on from the "
                "scan before",
                self.root,
                unshared,
            )
        self._scan_unshared = unshared is not None
        return _Run(total, evicted, freed, gone, gone_bytes, stale, trash, coordinated)
