"""The daemon side: everything here runs in the hicached daemon's process, on its event loop or its copy
threads. Grouped by concern: `server` (the Unix socket, admission, request dispatch), `l2` (the shared
pool, its slab allocator and the page index), `sched` (the tiers and the coroutines that move pages
between them: backup, prefetch, and the attached L3 backend with its breaker), `persist` (L2 kept over
restarts, crashes and takeovers, and the warm list), `regions` (engine memory regions and the copy
executor, host threads and CUDA streams) and `service` (the daemon's lifecycle, systemd notify, metrics).
Floors: `l2` imports nothing else of the daemon, `sched` only `l2`. Engines never import it."""
