"""The file backend's bound across the daemons that share one root (storage.file.max_bytes on NFS, Lustre,
3FS): each daemon's ledger of the bytes it wrote and removed, the last janitor run's scan, and the lease that
lets one janitor run at a time, all small files under `{root}/.fleet~`, which no namespace can name.

What the file system must provide: a rename that replaces a file whole (ledgers and scans are written under
a temporary name, then renamed), mtimes that move when a file is written (a ledger not written for STALE_S
is a dead daemon's; compared with the mtime of this daemon's own, just written, so no daemon's clock
matters), and flock() that excludes across nodes. Linux emulates flock() on NFS with whole-file byte-range
locks (NLM for v3, the protocol itself for v4): it excludes across nodes, unless the mount says `nolock` or
`local_lock=flock|all` (then only the daemons of one node, silently), and it fails with ENOLCK where NLM
cannot be reached. Lustre needs `-o flock` (`-o localflock` is node-local; without either, ENOSYS). A FUSE
file system that does not implement flock() gets the kernel's node-local one. Where flock() fails
(NO_LOCKING), each janitor runs on its own, and says so once; where it is node-local, so does one janitor a
node. Either way evict() counts a page another janitor removed first as freed: together they remove no more
than the excess (give or take a page each, and scans racing with new writes), each scanning the whole tree."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

from .file_janitor import FLEET_DIR

NODES = "nodes"  # {root}/.fleet~/nodes/{tag}: each daemon's ledger
SCAN = "scan"  # {root}/.fleet~/scan: what the last janitor run found and left
LOCK = "janitor.lock"  # {root}/.fleet~/janitor.lock: flock()ed by the janitor that runs
HEARTBEAT_S = 60.0  # a ledger is written at least this often, changed or not
STALE_S = 600.0  # a ledger not written for this long is a dead daemon's: the next janitor run removes it

# The lease's answers.
HELD = "held"  # this daemon's janitor runs
TAKEN = "taken"  # another daemon's runs now: this one leaves the run to it
UNSUPPORTED = "unsupported"  # the file system has no flock() here: each daemon's janitor runs on its own
# flock() errors that say the file system cannot lock at all (NFS mounted `nolock` without
# `local_lock=flock`, Lustre without `-o flock`, FUSE file systems), not that someone holds the lock.
NO_LOCKING = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})
_MAX_FILE = 1 << 20  # the scan file holds a count per daemon: generous
_HOST = socket.gethostname()  # who wrote a ledger or a scan, for people reading them


def lease_outcome(err: OSError) -> str:
    """What a failed non-blocking flock() means: TAKEN, UNSUPPORTED, or the error raised again."""
    if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
        return TAKEN
    if err.errno in NO_LOCKING:
        return UNSUPPORTED
    raise err


@contextlib.contextmanager
def lease(root: str, flock: Callable[[int, int], None] = fcntl.flock) -> Iterator[str]:
    """The janitor's lease, for the `with` block: HELD (an exclusive flock on `{root}/.fleet~/janitor.lock`,
    released at its end, or by the kernel if the process dies), TAKEN (another daemon holds it) or
    UNSUPPORTED (the file system cannot lock). Other errors (the lock file cannot be made) are raised."""
    path = os.path.join(root, FLEET_DIR, LOCK)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        _make_dirs(root, (FLEET_DIR,))
        fd = os.open(path, flags, 0o600)
    try:
        try:
            flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            outcome = lease_outcome(e)
        else:
            outcome = HELD
        try:
            yield outcome
        finally:
            if outcome == HELD:
                with contextlib.suppress(OSError):
                    flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)  # releases the lock too; unlocking first says so where the file is shared over NFS


@dataclasses.dataclass(frozen=True)
class Scan:
    """What a janitor run left: the bytes of the page files after its removals, each daemon's ledger as it
    read them before it began (`snapshot`), and by whom, when, with which bound."""

    total: int
    snapshot: dict[str, int]
    seq: int = 0  # one more than the run before it: a refresh never takes an older scan for a newer one
    time: float = 0.0
    by: str = ""  # the daemon's tag
    host: str = ""
    pid: int = 0
    max_bytes: int = 0

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Scan | None:
        """None where the file is not a scan (damaged, or written by a later version that changed it)."""
        try:
            d = json.loads(data)
            snapshot = {str(k): int(v) for k, v in d["snapshot"].items()}
            return cls(
                int(d["total"]),
                snapshot,
                int(d.get("seq", 0)),
                float(d.get("time", 0.0)),
                str(d.get("by", "")),
                str(d.get("host", "")),
                int(d.get("pid", 0)),
                int(d.get("max_bytes", 0)),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


class Ledger:
    """This daemon's share of the estimate of the bytes under the root, and the estimate itself.

    Each daemon counts the bytes it added to the tree and took away (puts, deletes, corrupt pages removed,
    clears: `add`), cumulative since it started, and publishes the count in `{root}/.fleet~/nodes/{tag}`.
    A janitor run reads every daemon's count (the snapshot), scans the tree, removes pages, and writes
    `{root}/.fleet~/scan`: the total after its removals and the snapshot. Every daemon's estimate is then
    the last scan's total plus what each daemon's count moved since that snapshot (a daemon absent from it
    counts whole: it began since; one whose ledger is gone counts nothing more). With `shared` False (no
    bound) nothing is written or read: the estimate is this daemon's last scan and its changes since.

    Thread-safe: `add` runs on io threads and the loop, `refresh` on a thread of its own, `begin_run` and
    `end_run` on the janitor's."""

    def __init__(self, root: str, tag: str, shared: bool) -> None:
        self.root = root
        self.tag = tag
        self.shared = shared
        self._lock = threading.Lock()
        self._net = 0  # bytes this daemon added to the tree less those it took away
        self._base = 0  # the estimate less _net
        self._scan: Scan | None = None
        self._gen = 0  # bumped by each run of our own: a refresh that began before one drops its figures
        self._counts: dict[str, int] = {}  # every daemon's ledger, as last read
        self._published: int | None = None
        self._published_at = 0.0  # time.monotonic()
        self._publishing = threading.Lock()  # one temporary name per daemon: one write at a time

    def add(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self._net += nbytes

    @property
    def estimate(self) -> int:
        """Bytes of the page files under the root, every daemon's included: exact after a scan, estimated
        between (the others' writes reach it at each refresh)."""
        return self._base + self._net

    @property
    def scan_seq(self) -> int:
        """The sequence number of the last scan known here (0: none)."""
        scan = self._scan
        return scan.seq if scan is not None else 0

    def info(self) -> dict:
        scan = self._scan
        out: dict = {"estimate": self.estimate, "node": self.tag, "nodes": len(self._counts)}
        if scan is not None:
            out.update(
                last_scan=scan.time,
                last_scan_total=scan.total,
                last_scan_by=f"{scan.host}:{scan.pid} ({scan.by})" if scan.host else scan.by,
                last_scan_max_bytes=scan.max_bytes,
            )
        return out

    def refresh(self, heartbeat_s: float = HEARTBEAT_S) -> None:
        """Publishes this daemon's count where it changed (or once every `heartbeat_s`), then reads the last
        scan and every daemon's count, and recomputes the estimate. Blocking: for a thread of its own."""
        if not self.shared:
            return
        with self._lock:
            gen = self._gen
        failed: OSError | None = None
        if self._net != self._published or time.monotonic() - self._published_at >= heartbeat_s:
            try:
                self.publish()
            except OSError as e:  # a full file system, say: the others' counts can still be read
                failed = e
        scan = read_scan(self.root)  # before the counts: they are then as new as its snapshot, or newer
        counts = self._read_counts()
        with self._lock:
            if gen == self._gen:  # else a run of ours ended meanwhile: its figures are newer than these
                if scan is not None and (self._scan is None or scan.seq >= self._scan.seq):
                    self._scan = scan
                self._counts = counts
                self._recompute()
        if failed is not None:
            raise failed

    def publish(self) -> int:
        """Writes this daemon's count to its ledger (a temporary file renamed over it); the count written."""
        with self._publishing:
            count = self._net
            data = json.dumps({"bytes": count, "host": _HOST, "pid": os.getpid()}).encode()
            _replace(self.root, (FLEET_DIR, NODES), self.tag, data)
            self._published, self._published_at = count, time.monotonic()
            return count

    def begin_run(self) -> dict[str, int]:
        """A janitor run's snapshot, taken before it scans: this daemon's count now (published with it) and
        every other daemon's ledger, those of dead daemons (not written for STALE_S) removed first. Where
        the fleet's files cannot be written or read (a full file system: the run may be what frees space),
        what the others last saw of this daemon and what it last read of them."""
        if not self.shared:
            return {self.tag: self._net}
        try:
            own: int | None = self.publish()
            remove_stale(self.root, self.tag)
            counts = self._read_counts()
        except OSError:
            own, counts = self._published, dict(self._counts)
        counts.pop(self.tag, None)
        if own is not None:
            counts[self.tag] = own
        return counts

    def end_run(self, total: int, snapshot: dict[str, int], max_bytes: int) -> OSError | None:
        """The run found `total` bytes after its removals: the estimate starts again from there, and the
        other daemons learn of it from the scan file. The error where that file could not be written (the
        others then go on from the scan before)."""
        seq = self.scan_seq + 1
        failed = None
        if self.shared:
            with contextlib.suppress(OSError):
                before = read_scan(self.root)  # under the lease: the newest there is
                seq = max(seq, before.seq + 1 if before is not None else 1)
        scan = Scan(total, snapshot, seq, time.time(), self.tag, _HOST, os.getpid(), max_bytes)
        if self.shared:
            try:
                _replace(self.root, (FLEET_DIR,), SCAN, scan.to_json())
            except OSError as e:
                failed = e
        with self._lock:
            self._gen += 1
            self._scan = scan
            self._counts = dict(snapshot)
            self._recompute()
        return failed

    def _recompute(self) -> None:
        """_base from the last scan and the counts (self._lock held)."""
        scan = self._scan
        snapshot = scan.snapshot if scan is not None else {}
        moved = sum(n - snapshot.get(tag, 0) for tag, n in self._counts.items() if tag != self.tag)
        self._base = (scan.total if scan is not None else 0) + moved - snapshot.get(self.tag, 0)

    def _read_counts(self) -> dict[str, int]:
        """Every daemon's ledger; for one that cannot be read now (not gone: an NFS hiccup), its last one."""
        out: dict[str, int] = {}
        directory = os.path.join(self.root, FLEET_DIR, NODES)
        try:
            names = [n for n in os.listdir(directory) if not n.startswith(".")]
        except FileNotFoundError:
            return out
        for name in names:
            try:
                count = _read_count(os.path.join(directory, name))
            except FileNotFoundError:
                continue  # removed since listed: a dead daemon's
            except OSError:
                count = self._counts.get(name)
            if count is not None:
                out[name] = count
        return out


def read_scan(root: str) -> Scan | None:
    try:
        with open(os.path.join(root, FLEET_DIR, SCAN), "rb") as f:
            return Scan.from_json(f.read(_MAX_FILE))
    except FileNotFoundError:
        return None


def remove_stale(root: str, own: str) -> list[str]:
    """Removes the ledgers (and temporary files) not written for STALE_S, by the file system's clock: each is
    compared with `own`'s ledger, just written, so the clocks of the daemons never matter. Their names."""
    directory = os.path.join(root, FLEET_DIR, NODES)
    try:
        now = os.stat(os.path.join(directory, own)).st_mtime
        with os.scandir(directory) as entries:
            listed = list(entries)
    except FileNotFoundError:
        return []
    removed = []
    for entry in listed:
        if entry.name == own:
            continue
        with contextlib.suppress(FileNotFoundError):
            if now - entry.stat(follow_symlinks=False).st_mtime > STALE_S:
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


def _read_count(path: str) -> int | None:
    """A ledger's count; None where the file is not one."""
    with open(path, "rb") as f:
        data = f.read(_MAX_FILE)
    try:
        return int(json.loads(data)["bytes"])
    except (ValueError, TypeError, KeyError):
        return None


def _replace(root: str, parts: tuple[str, ...], name: str, data: bytes) -> None:
    """Writes `root/parts.../name` whole: under a temporary name of this process, renamed over it. The
    directories are made where missing (the first daemon, or removed by hand), never the root itself."""
    directory = os.path.join(root, *parts)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        _make_dirs(root, parts)
        fd = os.open(tmp, flags, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _make_dirs(root: str, parts: tuple[str, ...]) -> None:
    """root/parts... made where missing; a missing root is an error (FileNotFoundError), not made again."""
    path = root
    for part in parts:
        path = os.path.join(path, part)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
