"""A TCP proxy for fault injection between a client and a real server: it forwards loopback connections and,
on demand, stalls them, slows them, resets them, or cuts a stream after so many bytes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable

LOOPBACK = "127.0.0.1"
_CHUNK = 1 << 16
# The receive buffer of the connections from the clients. Left to itself, the kernel grows it to tens of
# MiB on loopback, where a stalled or slowed proxy would take in whole values for the server: kept small,
# like a slow link's, so that what a client has not sent yet stays with the client.
_RCVBUF = 1 << 16
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset and drops what is unsent


class _Link:
    """One client connection and the proxy's connection to the server made for it."""

    __slots__ = ("client", "server", "stalled", "budget", "cut", "closed")

    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.client = client
        self.server = server
        self.stalled = False  # something was dropped: the streams are broken, resume() cuts them
        self.budget: tuple[int, int] | None = None  # (cut_after call, bytes it still lets through)
        self.cut = False  # cut_after fired: the server saw its bytes and an end, the client a reset
        self.closed = False

    def abort(self, rst: bool = False) -> None:
        self.closed = True
        for w in (self.client, self.server):
            _abort(w, rst)


def _abort(writer: asyncio.StreamWriter, rst: bool) -> None:
    if rst:
        sock = writer.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    writer.transport.abort()


class TcpProxy:
    """Forwards loopback connections to a server, on its own thread and event loop. Every byte is handed
    to the kernel before the next is read (no buffering in the proxy), and an end of stream, or a reset,
    from one side reaches the other as an end of stream after every byte before it.

    Modes, each in force until the next (called from any thread):
    - stall(): forward nothing; connections stay open and what flows through them is dropped (a hung peer).
    - slow(bytes_per_s=..., delay_per_read=...): forward everything, slowly, per connection and direction.
    - cut_after(n): let n more bytes from each client through, then cut its connection: the server sees
      those bytes and an end of stream (a value dropped halfway), the client a reset.
    - resume(): forward normally; connections that lost bytes in a stall are cut, others go on.
    And one action: reset() resets every open connection on both sides (close with SO_LINGER 0).
    bytes_up / bytes_down count the bytes forwarded to the server / to the clients; connections, those
    open."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._stalled = False
        self._rate: float | None = None
        self._delay: float | None = None
        self._cut: int | None = None
        self._cuts = 0  # cut_after calls so far
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Future[None] = self._loop.create_future()
        self._ready = threading.Event()
        self._done: asyncio.Future[None] | None = None
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True
        )

    @property
    def connections(self) -> int:
        return len(self._links)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._finish)
            self._thread.join(10)
        self._loop.close()

    def stall(self) -> None:
        """Drops what flows through every connection, open or opened from now on, until another mode; a
        connection that lost something this way stays broken, and resume() cuts it."""

        def change() -> None:
            self._normal()
            self._stalled = True

        self._change(change)

    def slow(self, bytes_per_s: float | None = None, delay_per_read: float | None = None) -> None:
        """Forwards at most bytes_per_s on each connection and direction, or waits delay_per_read after
        forwarding each read (of up to 64 KiB)."""
        if (bytes_per_s is None) == (delay_per_read is None):
            raise ValueError("slow() takes one of bytes_per_s and delay_per_read")

        def change() -> None:
            self._normal()
            self._rate, self._delay = bytes_per_s, delay_per_read

        self._change(change)

    def cut_after(self, n_bytes: int) -> None:
        """Forwards n_bytes more of what each client sends, open or connecting later, then cuts its
        connection; until resume(). Every client is cut: an HTTP client retries a PUT by itself."""

        def change() -> None:
            self._normal()
            self._cut = n_bytes
            self._cuts += 1

        self._change(change)

    def reset(self) -> None:
        """Resets every open connection, on both sides; the mode stays as it is."""

        def change() -> None:
            for link in list(self._links):
                link.abort(rst=True)

        self._change(change)

    def resume(self) -> None:
        """Forwards normally again; returns once the connections that lost bytes in a stall are cut."""

        def change() -> None:
            for link in [link for link in self._links if link.stalled]:
                link.abort()
            self._normal()

        self._change(change)

    def _normal(self) -> None:
        self._stalled = False
        self._rate = self._delay = self._cut = None

    def _change(self, change: Callable[[], None]) -> None:
        async def run() -> None:
            change()
            # Wakes connections that are waiting out a slow mode, so that they see the new one.
            self._wake.set_result(None)
            self._wake = self._loop.create_future()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def _finish(self) -> None:
        for link in list(self._links):
            link.abort()
        assert self._done is not None
        self._done.set_result(None)

    async def _serve(self) -> None:
        self._done = self._loop.create_future()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)  # the accepted sockets inherit it
        sock.bind((LOOPBACK, 0))
        server = await asyncio.start_server(self._handle, sock=sock)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._done
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
        except OSError:
            _abort(writer, rst=True)
            return
        link = _Link(writer, up_writer)
        for w in (writer, up_writer):
            w.transport.set_write_buffer_limits(0)  # drain() returns once the kernel has every byte
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pump(link, reader, up_writer, up=True),
                self._pump(link, up_reader, writer, up=False),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            pass  # close(): the proxy is going away, and so is every connection
        finally:
            self._links.discard(link)
            link.abort()

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool
    ) -> None:
        while True:
            try:
                data = await reader.read(self._read_size())
            except OSError:  # a reset: passed on as an end of stream, after every byte before it
                data = b""
            if link.closed:
                return
            if self._stalled or link.stalled:
                link.stalled = True
                if not data:
                    return  # the end of a stalled stream is dropped too
                continue
            if link.cut and not up:
                if not data:
                    return  # the server closed the connection that was cut
                continue
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            if up and self._cut is not None:
                if link.budget is None or link.budget[0] != self._cuts:
                    link.budget = (self._cuts, self._cut)
                left = link.budget[1]
                data = data[:left]
                link.budget = (self._cuts, left - len(data))
                if len(data) == left:
                    await self._forward(writer, data, up)
                    link.cut = True
                    writer.write_eof()  # the server reads every byte forwarded, then the end
                    _abort(link.client, rst=True)
                    return
            await self._forward(writer, data, up)
            await self._pace(len(data))

    async def _forward(self, writer: asyncio.StreamWriter, data: bytes, up: bool) -> None:
        writer.write(data)
        await writer.drain()
        if up:
            self.bytes_up += len(data)
        else:
            self.bytes_down += len(data)

    def _read_size(self) -> int:
        if self._rate is not None:
            return max(1, min(_CHUNK, int(self._rate / 20)))  # about 20 reads a second
        return _CHUNK

    async def _pace(self, n: int) -> None:
        if self._rate is not None:
            delay = n / self._rate
        elif self._delay is not None:
            delay = self._delay
        else:
            return
        await asyncio.wait({self._wake}, timeout=delay)
