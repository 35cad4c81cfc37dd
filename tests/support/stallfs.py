"""A FUSE passthrough filesystem over a real directory, served by a subprocess of its own, that a test can
stall (every operation waits: a hung NFS server or disk) or slow down, as TcpProxy does for network stores.

Run as a script, this module is that subprocess: `stallfs.py BACKING MOUNTPOINT CONTROL_FD PARENT_PID`."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_FUSECTL = "/sys/fs/fuse/connections"
_MNT_DETACH = 2
_AT_FDCWD = -100
_AT_SYMLINK_NOFOLLOW = 0x100
_PR_SET_PDEATHSIG = 1


class StallFSError(RuntimeError):
    """The filesystem did not mount, or its server stopped answering its control socket."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _unescape(field: str) -> str:
    """A path as /proc/self/mountinfo writes it: space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, "major:minor", filesystem type) of each mount this process sees. Read from
    /proc/self/mountinfo, never from the mounts themselves: a stat of a stalled mount would hang."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out.append((_unescape(fields[4]), fields[2], fields[sep + 1]))
    return out


def _fusectl_mounted() -> bool:
    return any(point == _FUSECTL and fstype == "fusectl" for point, _, fstype in _mounts())


def _mount_fusectl() -> bool:
    """Mounts the FUSE control filesystem, through which a connection is aborted, where it is missing (as
    on a machine booted without systemd). Needs CAP_SYS_ADMIN; False where it is not to be had."""
    if _fusectl_mounted():
        return True
    if not os.path.isdir(_FUSECTL):
        return False
    if _libc().mount(b"fusectl", _FUSECTL.encode(), b"fusectl", 0, None) != 0:
        return _fusectl_mounted()  # another process may have mounted it in between
    return True


@functools.cache
def stallfs_available() -> str | None:
    """None where a StallFS can be mounted here, else why not (for a test to skip with). The first call
    mounts and unmounts one: the only sure answer in a container that has /dev/fuse but no right to mount."""
    if not sys.platform.startswith("linux"):
        return f"FUSE is Linux-only here ({sys.platform})"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse3 is not installed (Debian: apt-get install libfuse3-3 fuse3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "the mfusepy package is not installed"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "not root, and no fusermount3 to mount with (Debian: apt-get install fuse3)"
    with tempfile.TemporaryDirectory(prefix="stallfs-check-") as tmp:
        backing, mnt = Path(tmp, "backing"), Path(tmp, "mnt")
        backing.mkdir()
        try:
            with StallFS(backing, mnt, start_timeout=15.0):
                pass
        except (StallFSError, OSError) as e:
            return f"a FUSE filesystem does not mount here: {str(e).splitlines()[0]}"
    return None


class StallFS:
    """`backing` served at `mountpoint` through FUSE by a subprocess: every operation reaches the backing
    directory through it (no attribute, entry or page caching in the kernel), so that each one can be held.

    Modes, each in force until the next (from any thread; none touches the mount):
    - stall(): every operation waits, those in flight and those to come: a hung disk or NFS server. Threads
      that touch the mount wait in the kernel (wchan request_wait_answer) until resume() or close().
    - slow(delay_per_op=...): every operation waits that long before it runs.
    - resume(): operations run at once; those waiting go on.
    `ops` counts the operations served so far and `waiting` those held now (stats() reads both at once).

    close() (or leaving the `with`) resumes, unmounts (lazily where something still holds the mount open),
    and, if the server has not ended within `teardown_grace`, aborts the connection
    (/sys/fs/fuse/connections/N/abort): every request still waiting fails with ENOTCONN, so no process is
    left blocked, not even one killed while it waited (the kernel waits uninterruptibly, state D, for a
    request already handed to the server). Then the server is killed if need be.

    The server is killed with the thread that started it (a test process killed while its threads wait on
    the mount): start and close a StallFS from one thread that lives as long as it does."""

    def __init__(
        self,
        backing: str | os.PathLike[str],
        mountpoint: str | os.PathLike[str],
        *,
        start_timeout: float = 20.0,
        teardown_grace: float = 5.0,
    ) -> None:
        self.backing = os.path.realpath(backing)
        self.mountpoint = os.path.abspath(mountpoint)
        self.start_timeout = start_timeout
        self.teardown_grace = teardown_grace
        self.connection: int | None = None  # N of /sys/fs/fuse/connections/N
        self.aborted = False  # close() had to abort the connection
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._buf = b""
        self._lock = threading.Lock()  # one request on the control socket at a time
        self._stderr: Any = None

    def __enter__(self) -> StallFS:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if not os.path.isdir(self.backing):
            raise StallFSError(f"backing directory {self.backing} does not exist")
        os.makedirs(self.mountpoint, exist_ok=True)
        self.mountpoint = os.path.realpath(self.mountpoint)
        _mount_fusectl()
        ours, theirs = socket.socketpair()
        # A file, not a pipe: fusermount3 (auto_unmount) inherits it and outlives the server a moment.
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    self.backing,
                    self.mountpoint,
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                start_new_session=True,  # a ^C in the test's terminal is for the test, which then unmounts
            )
        finally:
            theirs.close()
        self._sock = ours
        try:
            reply = self._read_line(self.start_timeout)
            if reply != "ready":
                raise StallFSError(f"unexpected first line from the server: {reply!r}")
            self.connection = self._find_connection()
        except BaseException:
            self.close()
            raise

    def _find_connection(self) -> int:
        ours = [
            dev for point, dev, fstype in _mounts() if point == self.mountpoint and fstype.startswith("fuse")
        ]
        if not ours:
            raise StallFSError(f"{self.mountpoint} is not in /proc/self/mountinfo after the server started")
        return int(ours[-1].split(":")[1])  # the last: mounted over any other there

    @property
    def server_pid(self) -> int | None:
        """The pid of the server process (None when not running)."""
        return None if self._proc is None else self._proc.pid

    # Modes and counters.

    def stall(self) -> None:
        self._request("stall")

    def slow(self, delay_per_op: float) -> None:
        if delay_per_op <= 0:
            raise ValueError("delay_per_op must be positive; resume() runs operations at full speed")
        self._request(f"slow {delay_per_op!r}")

    def resume(self) -> None:
        self._request("resume")

    def stats(self) -> dict[str, Any]:
        """{"ops": operations served so far, "waiting": operations held now, "waiting_tids": the threads
        whose requests those are (FUSE names the caller's thread id; 0 for the kernel's own requests, such
        as the release of a file closed)}."""
        return json.loads(self._request("stats"))

    @property
    def ops(self) -> int:
        return self.stats()["ops"]

    @property
    def waiting(self) -> int:
        return self.stats()["waiting"]

    def holds(self, pid: int) -> bool:
        """Whether a request of process `pid` is held now: the server has it, and the caller waits for its
        answer (a background request, the release of a file closed before the stall, is no proof that a
        stall has caught what a test started)."""
        return any(
            tid == pid or os.path.exists(f"/proc/{pid}/task/{tid}")
            for tid in self.stats()["waiting_tids"]
            if tid
        )

    def wait_holds(self, pid: int, timeout: float = 10.0) -> None:
        """Returns once a request of process `pid` is held (blocking: for tests that are not coroutines)."""
        deadline = time.monotonic() + timeout
        while not self.holds(pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request of process {pid} held after {timeout}s")
            time.sleep(0.01)

    # The control socket.

    def _request(self, line: str, timeout: float = 10.0) -> str:
        if self._sock is None:
            raise StallFSError("not started")
        with self._lock:
            self._sock.sendall(line.encode() + b"\n")
            reply = self._read_line(timeout)
        status, _, rest = reply.partition(" ")
        if status != "ok":
            raise StallFSError(f"{line!r}: {reply}")
        return rest

    def _read_line(self, timeout: float) -> str:
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._sock], [], [], left)[0]:
                raise StallFSError(f"no answer from the server within {timeout}s{self._why_dead()}")
            chunk = self._sock.recv(4096)
            if not chunk:
                if self._proc is not None:  # ending: give it a moment, for its exit status and last words
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._proc.wait(2.0)
                raise StallFSError(f"the server closed its control socket{self._why_dead()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def _why_dead(self) -> str:
        if self._proc is None or self._proc.poll() is None:
            return ""
        self._stderr.seek(0)
        err = self._stderr.read().decode(errors="replace").strip()
        return f" (it exited with {self._proc.returncode}: {err[-2000:]})"

    # Teardown.

    def _mounted(self) -> bool:
        return any(point == self.mountpoint and fstype.startswith("fuse") for point, _, fstype in _mounts())

    def _unmount(self) -> None:
        libc = _libc()
        path = self.mountpoint.encode()
        if self._mounted() and libc.umount2(path, 0) != 0:
            # Busy: a file still open, or a thread still in a call there. Detached now, ended when the
            # last user lets go (at the latest once the connection is aborted).
            libc.umount2(path, _MNT_DETACH)

    def _abort(self) -> None:
        if self.connection is None:
            return
        path = f"{_FUSECTL}/{self.connection}/abort"
        with contextlib.suppress(FileNotFoundError):  # the connection is gone already
            if not os.path.exists(path) and not _mount_fusectl():
                return
            with open(path, "w") as f:
                f.write("1")
            self.aborted = True

    def close(self) -> None:
        """Idempotent. Leaves no mount, no server and no process blocked on this filesystem."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError, StallFSError):
                self._request("resume", timeout=min(2.0, self.teardown_grace))
        self._unmount()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(self.teardown_grace)
        if proc.poll() is None:
            # Still serving: the mount is still held (detached above, in use) or the server is stuck. Once
            # the server is gone, the kernel has aborted the connection itself (its /dev/fuse closed).
            self._abort()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(min(1.0, self.teardown_grace))  # its reads now fail: a server that runs leaves
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._unmount()  # a server killed before the kernel let go of the mount leaves it detached here
        if self._sock is not None:
            self._sock.close()
        self._stderr.close()
        self._proc = None


# The server: runs in the subprocess only.


class _Gate:
    """Holds operations while stalled, delays them while slow; counts them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.stalled = False
        self.delay = 0.0
        self.ops = 0
        self.waiting: collections.Counter[int] = collections.Counter()  # by the caller's thread id

    def enter(self, tid: int) -> None:
        with self.cond:
            self.waiting[tid] += 1
            try:
                deadline: float | None = None
                while True:
                    if self.stalled:
                        self.cond.wait()
                        continue
                    if self.delay <= 0:
                        break
                    now = time.monotonic()
                    deadline = now + self.delay if deadline is None else deadline
                    if now >= deadline:
                        break
                    self.cond.wait(deadline - now)  # a resume() cuts the delay short
            finally:
                self.waiting[tid] -= 1
                if not self.waiting[tid]:
                    del self.waiting[tid]

    def served(self) -> None:
        with self.cond:
            self.ops += 1

    def set(self, stalled: bool, delay: float) -> None:
        with self.cond:
            self.stalled, self.delay = stalled, delay
            self.cond.notify_all()


def _serve(backing: str, mountpoint: str, control: socket.socket) -> None:
    import mfusepy  # only the server needs it (and libfuse3, which it loads)

    gate = _Gate()
    libc = _libc()
    libc.utimensat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
    libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]

    def gated(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def op(self: Any, *args: Any) -> Any:
            gate.enter(mfusepy.fuse_get_context()[2])
            try:
                return fn(self, *args)
            finally:
                gate.served()

        return op

    def check(rc: int) -> int:
        if rc != 0:
            raise mfusepy.FuseOSError(ctypes.get_errno())
        return 0

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def _full(self, path: str) -> str:
            return backing + path

        def _own(self, full: str) -> None:
            """Gives a new file the caller's ids, as a local filesystem would (the server runs as root)."""
            uid, gid, _ = mfusepy.fuse_get_context()
            if (uid, gid) != (os.geteuid(), os.getegid()):
                os.lchown(full, uid, gid)

        def init_with_config(self, conn: Any, config: Any) -> None:
            # Nothing cached in the kernel: every lookup, stat, read and write comes here and can be held.
            config.entry_timeout = config.negative_timeout = config.attr_timeout = 0.0
            config.direct_io = 1
            config.hard_remove = 1  # no .fuse_hidden files in the tree for an unlinked file still open
            control.sendall(b"ready\n")

        @gated
        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
            names = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_rdev")
            attrs = {name: getattr(st, name) for name in names}
            attrs |= {"st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}
            return attrs

        @gated
        def access(self, path: str, amode: int) -> int:
            if not os.access(self._full(path), amode, follow_symlinks=False):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        @gated
        def readlink(self, path: str) -> str:
            return os.readlink(self._full(path))

        @gated
        def mknod(self, path: str, mode: int, dev: int) -> int:
            os.mknod(self._full(path), mode, dev)
            self._own(self._full(path))
            return 0

        @gated
        def mkdir(self, path: str, mode: int) -> int:
            os.mkdir(self._full(path), mode)
            self._own(self._full(path))
            return 0

        @gated
        def unlink(self, path: str) -> int:
            os.unlink(self._full(path))
            return 0

        @gated
        def rmdir(self, path: str) -> int:
            os.rmdir(self._full(path))
            return 0

        @gated
        def symlink(self, target: str, source: str) -> int:
            os.symlink(source, self._full(target))
            self._own(self._full(target))
            return 0

        @gated
        def link(self, target: str, source: str) -> int:
            os.link(self._full(source), self._full(target), follow_symlinks=False)
            return 0

        @gated
        def rename(self, old: str, new: str, flags: int = 0) -> int:
            if not flags:
                os.rename(self._full(old), self._full(new))
                return 0
            old_b, new_b = os.fsencode(self._full(old)), os.fsencode(self._full(new))
            return check(libc.renameat2(_AT_FDCWD, old_b, _AT_FDCWD, new_b, flags))

        @gated
        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._full(path), mode, follow_symlinks=False)
            return 0

        @gated
        def chown(self, path: str, uid: int, gid: int) -> int:
            os.chown(self._full(path), uid, gid, follow_symlinks=False)
            return 0

        @gated
        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(self._full(path), length)
            return 0

        @gated
        def utimens(self, path: str, times: Any) -> int:
            # `times`: the kernel's two struct timespec as they came (see _Fuse): UTIME_NOW and UTIME_OMIT
            # pass through to utimensat, which os.utime cannot express.
            return check(
                libc.utimensat(_AT_FDCWD, os.fsencode(self._full(path)), times, _AT_SYMLINK_NOFOLLOW)
            )

        @gated
        def open(self, path: str, flags: int) -> int:
            return os.open(self._full(path), flags & ~(os.O_CREAT | os.O_EXCL))

        @gated
        def create(self, path: str, mode: int, flags: int) -> int:
            fd = os.open(self._full(path), flags | os.O_CREAT, mode)
            self._own(self._full(path))
            return fd

        @gated
        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        @gated
        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            return os.pwrite(fh, data, offset)

        @gated
        def flush(self, path: str, fh: int) -> int:
            return 0

        @gated
        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        @gated
        def fsync(self, path: str, datasync: int, fh: int) -> int:
            (os.fdatasync if datasync else os.fsync)(fh)
            return 0

        @gated
        def opendir(self, path: str) -> int:
            os.close(os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY))
            return 0

        @gated
        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._full(path))]

        @gated
        def releasedir(self, path: str, fh: int) -> int:
            return 0

        @gated
        def statfs(self, path: str) -> dict[str, int]:
            sv = os.statvfs(self._full(path))
            names = (
                "f_bsize",
                "f_frsize",
                "f_blocks",
                "f_bfree",
                "f_bavail",
                "f_files",
                "f_ffree",
                "f_namemax",
            )
            return {name: getattr(sv, name) for name in names}

    class _Fuse(mfusepy.FUSE):
        # mfusepy drops rename's flags (RENAME_NOREPLACE, RENAME_EXCHANGE) and turns utimens' timespecs
        # into numbers that cannot say "now" or "leave as is": both passed on as the kernel sent them.
        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            return self.operations.rename(old.decode(), new.decode(), flags)

        def utimens_fuse_3(self, path: bytes | None, buf: Any, fip: Any) -> int:
            if path is None:
                return -errno.ENOSYS
            return self.operations.utimens(path.decode(), buf)

    def control_loop() -> None:
        buf = b""
        while True:
            try:
                chunk = control.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                # The test process is gone, or closed us without unmounting. Leaving closes /dev/fuse: the
                # kernel aborts the connection, failing every request still waiting (auto_unmount unmounts).
                os._exit(0)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd, _, arg = line.decode().partition(" ")
                if cmd == "stall":
                    gate.set(True, 0.0)
                    reply = "ok"
                elif cmd == "slow":
                    gate.set(False, float(arg))
                    reply = "ok"
                elif cmd == "resume":
                    gate.set(False, 0.0)
                    reply = "ok"
                elif cmd == "stats":
                    with gate.cond:
                        stats = {
                            "ops": gate.ops,
                            "waiting": gate.waiting.total(),
                            "waiting_tids": sorted(gate.waiting),
                        }
                    reply = "ok " + json.dumps(stats)
                else:
                    reply = f"error unknown command {cmd!r}"
                control.sendall(reply.encode() + b"\n")

    threading.Thread(target=control_loop, name="stallfs-control", daemon=True).start()
    options: dict[str, Any] = {"fsname": "stallfs", "default_permissions": True}
    if os.geteuid() == 0:
        options["allow_other"] = True  # a daemon under test may run as another user
    if shutil.which("fusermount3"):
        # A helper unmounts the filesystem if this process dies without doing so.
        options["auto_unmount"] = True
    _Fuse(Passthrough(), mountpoint, foreground=True, **options)


def _die_with_parent(parent: int) -> None:
    """Killed when the thread that started us ends. A test process killed while one of its threads waits
    on a stalled mount cannot finish dying (that thread waits, in state D, for our answer) and so never
    closes the control socket: its main thread's end is the sign to go, and our end frees it."""
    if _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
        os._exit(1)  # gone already: nobody to serve


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[4]))
    os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")  # mfusepy would take libfuse2 first where both exist
    _serve(sys.argv[1], sys.argv[2], socket.socket(fileno=int(sys.argv[3])))
