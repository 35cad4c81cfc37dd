"""The file backend's capacity bound (storage.file.max_bytes): the estimate of the bytes stored, and the
janitor task that has file_janitor scan the tree on its own thread and remove pages past the bound."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from . import file_janitor

log = logging.getLogger("hicached.connectors.file")


class Bound:
    """Methods of FileConnector (file.py holds the state): the bytes it stores, and the janitor."""

    def _add_stored(self, nbytes: int) -> None:
        if nbytes:
            with self._stored_lock:
                self._stored += nbytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of the page files under root, headers included: exact after a scan, estimated between."""
        return self._stored

    async def enforce_bound(self) -> int:
        """Scans the tree (on the janitor thread): counts the bytes stored, removes temporary files and
        trees of cleared namespaces left by a crash, and when over `max_bytes` removes the least recently
        used pages down to the low watermark. Returns how many pages it removed."""
        async with self._enforcing:
            loop = asyncio.get_running_loop()
            done = await loop.run_in_executor(self._scan_executor, self._enforce, self._stop)
            self._scanned.set()
            if done is None:  # stopped by close()
                return 0
            evicted, freed, stale, trash = done
            self.counters["evictions"] += evicted
            self.counters["evicted_bytes"] += freed
            self.counters["stale_temp_removed"] += stale
            self.counters["stale_trash_removed"] += trash
            if evicted:
                log.info(
                    "file: %s was over its bound of %d bytes; removed %d least recently used pages, %d bytes",
                    self.root,
                    self._max_bytes,
                    evicted,
                    freed,
                )
            if stale:
                log.info("file: removed %d temporary files left by an earlier crash", stale)
            if trash:
                log.info("file: removed %d namespace trees left by clears that did not finish", trash)
            return evicted

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
            if failing or (self._stored > self._max_bytes and not evicted):
                # Over, yet nothing could be removed: wait an interval rather than scan again on every put.
                await asyncio.sleep(self._janitor_interval)
                continue
            # Under the bound: wait for a put that crosses it, looking at the estimate every interval too,
            # or for crash leftovers to turn stale. Still over after removing pages: new pages came in
            # meanwhile, so go again at once.
            while self._stored <= self._max_bytes:
                wait = self._janitor_interval
                if due is not None:
                    if time.time() >= due:
                        break
                    wait = min(wait, due - time.time())
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()

    # The janitor's side, run on its own thread.

    def _enforce(self, stop: threading.Event) -> tuple[int, int, int, int] | None:
        """One janitor run: (pages removed, their bytes, stale temporary files removed, trees of unfinished
        clears removed); None if stopped."""
        trash = file_janitor.remove_trash(self.root, self._clearing, stop)
        with self._stored_lock:
            before = self._stored
        scanned = file_janitor.scan(
            self.root, stop, collect=self._max_bytes > 0, own_tag=self._tmp_tag, clearing=self._clearing
        )
        if scanned is None:
            return None
        total, pages, stale, self._leftovers_due = scanned
        evicted = freed = 0
        if self._max_bytes and total > self._max_bytes:
            pages.sort()
            for used, size, ino, path in pages:
                if total - freed <= self._low_bytes or stop.is_set():
                    break
                if file_janitor.evict(path, ino, used):
                    evicted += 1
                    freed += size
        with self._stored_lock:  # what puts and deletes changed during the scan counts on top of it
            self._stored = total - freed + (self._stored - before)
        return evicted, freed, stale, trash
