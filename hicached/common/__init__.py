"""Code with no process of its own, imported by the engine side, the daemon side and the connectors alike,
and importing none of them: the wire protocol (frames, requests, answers), page keys and namespaces, the
error codes, region geometry, sealed shared memory, retry with backoff, and the compiled page I/O
(`_pageio`: copies with the GIL released, the file connector's I/O threads, xxh3)."""
