"""A TCP proxy for fault injection: it forwards loopback connections to a server and can stall them, to
play a peer that accepts connections and then never answers."""

from __future__ import annotations

import asyncio
import threading

LOOPBACK = "127.0.0.1"


class TcpProxy:
    """Forwards loopback connections to a server, on its own thread and event loop. stall() keeps every
    connection open but drops what flows through it (a peer that hangs); resume() cuts the stalled
    connections and forwards again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._stalled = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._done: asyncio.Future[None] | None = None
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True
        )

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
        self._stalled = True

    def resume(self) -> None:
        """Returns once the stalled connections are cut and new ones are forwarded."""
        asyncio.run_coroutine_threadsafe(self._resume(), self._loop).result(10)

    async def _resume(self) -> None:
        self._cut()
        self._stalled = False

    def _finish(self) -> None:
        self._cut()
        assert self._done is not None
        self._done.set_result(None)

    def _cut(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _serve(self) -> None:
        self._done = self._loop.create_future()
        server = await asyncio.start_server(self._handle, LOOPBACK, 0)
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
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(
            self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
        )
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            if not self._stalled:
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
