"""The configuration schema: every section, key, default and bound of hicached, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from .units import GiB, MiB, TiB

# Markers read by the loader: a Size is written "4GiB" (or bytes), a Duration "500ms" (or seconds),
# a Mode an octal string such as "0660".
Size = Annotated[int, "size"]
Duration = Annotated[float, "duration"]
Mode = Annotated[int, "mode"]
Path = Annotated[str, "path"]

Backend = Literal["none", "file", "redis", "s3"]
WritePolicy = Literal["write_through", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
Eviction = Literal["auto", "slru", "lru"]
LogLevel = Literal["debug", "info", "warning", "error"]
BacklogFull = Literal["drop_oldest", "refuse"]

# Bound on the [tenants.NAME] tables: each tenant's listening socket is one fd of a takeover's hand-over
# message, and SCM_RIGHTS carries at most 253 fds in one message.
MAX_TENANTS = 128

# Bound on the backend calls in flight per direction and on the file backend's I/O threads: each is a task or
# a thread that a reload starts at once, and a typo of a few digits must not stall the daemon.
MAX_CONCURRENCY = 1024


@dataclass
class ServerConfig:
    # The Unix socket engines connect to.
    socket: Path = "run/hicached.sock"
    # Its mode, set at bind time.
    socket_mode: Mode = 0o660
    # Engines: peers admitted when their uid OR (primary) gid is listed, checked with SO_PEERCRED. Empty: no
    # engine besides the operators (docs/security.md).
    allowed_uids: list[int] = field(default_factory=list)
    allowed_gids: list[int] = field(default_factory=list)
    # Operators, besides root and the daemon's own uid (always operators): admitted whatever allowed_uids
    # says, and the only peers whose controls change the daemon (reload, drain, backend attach/detach, flush).
    operator_uids: list[int] = field(default_factory=list)
    operator_gids: list[int] = field(default_factory=list)
    # Bounds per daemon and per connection. Connections still in their handshake count; the short side
    # connection that registers a host region does not, as it belongs to a connection already counted. A peer
    # that leaves more than max_frame of answers unread is not read from until it catches up (over all
    # connections, see max_pending_bytes).
    max_connections: int = 1024
    max_frame: Size = 8 * MiB
    max_keys_per_request: int = 65536
    max_inflight_per_connection: int = 64
    max_prefetch_handles_per_connection: int = 4096
    # A connection that has sent neither a whole hello nor a whole control request by then is answered
    # `timeout` and closed: a peer that connects and sends nothing (or half a frame) cannot hold one of
    # max_connections for ever. An engine idle after its hello, and a control request still running, never
    # are. Also bounds a region's side connection.
    handshake_timeout: Duration = 5.0
    # Bytes held for unfinished request frames and for answers the peers have not read, over all
    # connections. Without it the bound is max_connections x max_frame x 2 (16GiB at the defaults). 256MiB is
    # 32 frames of max_frame in flight at once: engines send requests of KiBs (a max_keys_per_request
    # request is ~4.5MiB), so only a peer that holds frames open on purpose meets it, and it stays small
    # next to the pool. Past it the daemon stops reading from the connections that hold bytes, and closes
    # those that keep them longer than request_timeout, the biggest first.
    max_pending_bytes: Size = 256 * MiB
    # Upper bound on how long the daemon waits on anything for one request (L3 reads in a load).
    request_timeout: Duration = 30.0


@dataclass
class PoolConfig:
    # L2's size: shared memory, allocated whole at start when prefault (docs/operations.md, "Memory"). A
    # whole number of slabs: the pool holds whole slabs only, so a size between two is refused.
    capacity: Size = 1 * GiB
    # Unit of memory handed to a size class; also the largest page the pool accepts.
    slab_size: Size = 32 * MiB
    # true: the pool is allocated whole at start, and refused when it does not fit in the memory left; false:
    # it is allocated as it fills, and a pool that does not fit only warns.
    prefault: bool = True
    # At start, a prefaulted pool larger than the memory left waits this long for memory before the daemon
    # gives up: after a restart, engines still mapping the previous daemon's pool hold its memory until
    # their clients see the connection gone.
    memory_wait: Duration = 60.0
    # Write-back: when fewer than this fraction of slots are free or evictable, dirty pages are written out.
    writeback_low_watermark: float = 0.10
    # Pins keep pages in L2 across evictions; bounded so that pins cannot starve stores.
    max_pinned_fraction: float = 0.5
    # Slots each connection may hold ahead for its next stores, so that a store copies at once instead of
    # first waiting for slots (one round trip fewer). A store takes up to half of them, so 32 MiB covers a
    # call of 64 pages of 256 KiB. 0 turns it off. Bounded over all connections too.
    reserve_per_connection: Size = 32 * MiB
    # The bound on those slots over all connections, as a share of the pool.
    reserve_max_fraction: float = 0.125
    # What L2 evicts first (hicached.daemon.l2.index): "lru"; "slru" (segmented LRU with a ghost of
    # recent evictions: pages used again are kept over pages stored once; 1.04-1.07x LRU's hits on the
    # Mooncake trace, up to 11% fewer on multi-turn traffic); or "auto": slru's lists kept, and LRU or
    # slru followed, whichever two small shadow caches of one key in eight show winning on the traffic
    # of the moment (docs/sizing.md).
    eviction: Eviction = "lru"


@dataclass
class RetryConfig:
    """Backoff for failed backups (and the Redis client's retries)."""

    attempts: int = 5
    base: Duration = 0.05
    max: Duration = 5.0
    jitter: float = 0.2


@dataclass
class PrefetchConfig:
    # How a client's `wait` waits for a prefetch: "best_effort" (not at all), "wait_complete", or "timeout"
    # (timeout_base, plus timeout_per_page for each page still in flight).
    policy: PrefetchPolicy = "timeout"
    timeout_base: Duration = 0.05
    timeout_per_page: Duration = 0.002


@dataclass
class FileConfig:
    # One file per page under root/namespace/ab/cd/key, written to a temporary name and renamed; root is
    # created 0700.
    root: Path = "data"
    # Threads for page reads, and as many for writes. 0: twice the CPUs the daemon may run on, at most 8;
    # pages in the page cache make the I/O CPU-bound, and threads beyond that only contend for the GIL.
    io_threads: int = 0
    # Added to the CPU niceness of the threads that write pages (backups, 0..19; 0: same as the daemon;
    # the sum is capped at 19). Backups are background work: under CPU contention they yield to engines
    # and to reads, and they run at full speed on idle CPUs. With the C page I/O a backup no longer waits
    # for the GIL between pages: at +10, write-through stores of 2 MiB pages measured a median ~0.66x of
    # memcpy on 2 vCPUs; at +19, ~0.75x.
    write_nice: int = 19
    # true: the write threads also run under SCHED_IDLE. A CPU running only them counts as idle, so the
    # kernel wakes the daemon's event loop and the engines there at once instead of on the CPU of the
    # engine that woke it, and any of them preempts a write. Write-through stores of 256 KiB pages measured
    # 0.45-0.63x of memcpy (median 0.57x, 7 runs) against 0.44-0.53x (median 0.50x, 4 runs) without it, on
    # 2 vCPUs, before backup_defer. But when every CPU is busy, the writes get almost no CPU (1/5 of what
    # nice 19 leaves them): with two CPU hogs beside the test suite, backups fell so far behind that L2
    # filled with pages not yet in L3 and stores were refused. Off by default; for nodes with CPUs to spare.
    write_sched_idle: bool = False
    # true: page files are fsynced when written.
    fsync: bool = False
    # Bound on the bytes of page files under root (0: none), those of every daemon sharing it. Past it, a
    # janitor removes the least recently used pages down to low_watermark * max_bytes; it looks every
    # janitor_interval, and at once when the estimate crosses the bound. The daemons on one root should set
    # the same bound (each run uses its own daemon's; one without a bound is seen only at the next scan).
    max_bytes: Size = 0
    low_watermark: float = 0.9
    janitor_interval: Duration = 30.0
    # Seconds between a bounded daemon's looks at the other daemons sharing this root (one storage.file.root
    # on NFS, Lustre, 3FS): it publishes the bytes it wrote and removed under {root}/.fleet~ when they
    # changed (and every minute regardless), and reads the others' to keep the estimate of the whole tree
    # that max_bytes bounds. The tree may pass max_bytes by what the fleet writes in two periods (one to
    # publish, one to read) and one janitor run (connectors/file_fleet.py says what the file system must do).
    fleet_refresh: Duration = 1.0


@dataclass
class RedisConfig:
    # redis://, rediss:// or unix://; the file must set it for the redis backend (no default is used).
    url: str = "redis://127.0.0.1:6379/0"
    # true: a Redis Cluster (reached over TCP).
    cluster: bool = False
    # One key per page: {prefix}:{namespace}:{key}, header and payload together.
    prefix: str = "hicached"
    username: str = ""
    password: str = ""
    # Read the password from this environment variable when set (keeps secrets out of the TOML).
    password_env: str = ""
    # Expiry of the page keys; 0: none.
    ttl: Duration = 0.0
    max_connections: int = 32
    socket_timeout: Duration = 5.0
    connect_timeout: Duration = 2.0
    ssl_ca_certs: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"


@dataclass
class S3Config:
    """Credentials come from the standard AWS chain (environment, profile, instance role), never from the
    TOML."""

    # The file must set it for the s3 backend (no default is used).
    bucket: str = "hicached"
    # One object per page: {prefix}/{namespace}/{key}.
    prefix: str = "kv"
    # For S3-compatible stores; empty: AWS.
    endpoint_url: str = ""
    region: str = ""
    # "path" for most S3-compatible stores.
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    checksum: Literal["when_supported", "when_required"] = "when_required"
    max_connections: int = 32
    connect_timeout: Duration = 2.0
    read_timeout: Duration = 10.0
    max_attempts: int = 3


@dataclass
class BreakerConfig:
    # Consecutive failed backend calls that detach the backend (the daemon then serves from L2 only).
    failures: int = 5
    # While detached, the backend is probed with backoff between these bounds and re-attached once it answers.
    probe_interval: Duration = 1.0
    probe_max_interval: Duration = 30.0
    # A backend with calls in flight that finishes none of them for this long is stalled (a hung server, a
    # partition, a disk that stopped answering): detached at once, its calls in flight abandoned (their
    # pages are misses or stay in L2), and probed as after failures. 0: only time-outs and failures count.
    stall_timeout: Duration = 2.0
    # A call that has run this many times longer than that kind of call's recent typical time (and at least
    # stall_timeout) counts as one failure of the breaker's `failures` in a row: a backend that has become
    # far slower than itself is detached once its slow calls keep coming; one slow call is not. 0: off.
    slow_factor: float = 20.0


@dataclass
class StorageConfig:
    # "none" (L2 only), "file", "redis", "s3" (docs/operations.md, "Backends"). A network backend is used
    # only where the file names its store: [storage.redis] with url, or [storage.s3] with bucket.
    backend: Backend = "file"
    # "write_through": every stored page is backed up to L3; "write_back": pages go to L3 on memory pressure
    # and at shutdown.
    write_policy: WritePolicy = "write_through"
    # Concurrent backend calls per direction, and pages per call: at most *_batch_pages, and no more than
    # fit in *_batch_bytes (at least one). Bigger calls cost less per page; the byte cap keeps a call of big
    # pages within operation_timeout. 256 KiB and 2 MiB pages go 64 to a call, 16 MiB pages 8. With 32 MiB
    # calls (16 pages of 2 MiB), the daemon's backups ran at ~0.83x of the file connector's own speed and
    # prefetch at ~0.91x (many small jobs on the I/O threads); with 128 MiB, ~0.97x and ~0.95x (2 vCPUs).
    backup_concurrency: int = 4
    # Write-through backup calls in flight while engines are busy (a request in the last 10 ms); 0: no
    # limit. Backups are background work: on a node short of CPUs their I/O threads would otherwise take
    # the CPU and the GIL from the event loop that answers the engines. Idle, they run backup_concurrency.
    backup_concurrency_busy: int = 1
    # While engines are busy, a write-through backup first waits for them to pause, up to this long after its
    # page was stored; 0: no waiting. Its I/O would take memory bandwidth from the engines' copies: on 2
    # vCPUs a memcpy ran 7-23 % slower beside a SCHED_IDLE process writing files. Dirty pages cannot be
    # evicted, so this also bounds how much of L2 a burst of stores holds back from eviction.
    backup_defer: Duration = 0.1
    backup_batch_pages: int = 64
    backup_batch_bytes: Size = 128 * MiB
    # Bound on the pages queued for backup.
    backup_queue_pages: int = 65536
    # The same for prefetch (reads from L3 into L2).
    prefetch_concurrency: int = 8
    prefetch_batch_pages: int = 64
    prefetch_batch_bytes: Size = 128 * MiB
    prefetch_queue_pages: int = 65536
    # No longer used (accepted so that older files load): a page stored again is always written again, since
    # what L2 believed about L3 may be stale (hicached.daemon.l2.life).
    known_in_l3_keys: int = 262144
    # Write-through: pages acknowledged but not yet in L3 hold their slots (they cannot be evicted). Past this
    # share of the pool, when_backlog_full decides: "drop_oldest" stops holding the oldest of them for L3
    # (they stay in L2 as any page, counted as backup.dropped; backed up after all if the backend catches
    # up while they are still in L2), so that L2 keeps taking new pages whatever L3 does; "refuse" answers
    # new stores False instead. Write-back holds no page for L3 (pages are in L2 only by design).
    max_unbacked_fraction: float = 0.5
    when_backlog_full: BacklogFull = "drop_oldest"
    # Bound on each backend call.
    operation_timeout: Duration = 10.0
    # A swapped-out backend may finish the calls it has in flight for this long before it is closed.
    drain_timeout: Duration = 30.0
    # How often this node reads the clear epoch of each namespace it uses from the shared L3 (where every
    # node's clear() writes it: hicached.daemon.sched.epochs). After clear() returned on any node, no node
    # serves a page of the namespace stored before it once this, plus one store call (operation_timeout at
    # worst, milliseconds usually), has passed. 0: clears stay on this node (one node, or an L3 not shared).
    epoch_interval: Duration = 1.0
    retry: RetryConfig = field(default_factory=RetryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    file: FileConfig = field(default_factory=FileConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    s3: S3Config = field(default_factory=S3Config)

    def backup_batch(self, page_bytes: int) -> int:
        """Pages of `page_bytes` per backup call."""
        return batch_size(self.backup_batch_pages, self.backup_batch_bytes, page_bytes)

    def prefetch_batch(self, page_bytes: int) -> int:
        """Pages of `page_bytes` per prefetch call."""
        return batch_size(self.prefetch_batch_pages, self.prefetch_batch_bytes, page_bytes)


def batch_size(max_pages: int, max_bytes: int, page_bytes: int) -> int:
    """At most `max_pages` pages, no more than fit in `max_bytes`, at least one."""
    return max(1, min(max_pages, max_bytes // max(1, page_bytes)))


@dataclass
class LoggingConfig:
    # Of the daemon's log (stderr).
    level: LogLevel = "info"


@dataclass
class MetricsConfig:
    # "host:port" of a Prometheus text exposition listener (GET /metrics); empty: none. Keep it on loopback.
    listen: str = ""


@dataclass
class ShutdownConfig:
    # Bound on the final flush of pages not yet in L3 and on answering requests in flight.
    flush_timeout: Duration = 60.0


@dataclass
class RegionsConfig:
    # Engine memory regions (host memfds, CUDA tensors) that the daemon copies pages out of and into.
    max_per_connection: int = 64
    # Bound on the bytes of the regions one connection registers.
    max_bytes_per_connection: Size = 1 * TiB
    # Threads that copy between host regions and L2 (numpy copyto releases the GIL; keep it small).
    copy_threads: int = 2
    # A copy job running longer than this is stuck: the daemon stops pinging the systemd watchdog.
    copy_stall_timeout: Duration = 60.0


@dataclass
class WarmupConfig:
    # After a start, refill L2 from L3 with the pages it held before (pinned first), from the warm list.
    enabled: bool = True
    # Where the warm list is written.
    state_file: Path = "state/warm.msgpack"
    # At most this share of the pool is warmed; the rest is left for what engines ask for.
    max_fraction: float = 0.8
    # The warm list is also written this often, so a crash leaves a recent one. 0: only at shutdown.
    snapshot_interval: Duration = 60.0


@dataclass
class TenantConfig:
    """[tenants.NAME]: engines kept apart from the other tenants' (docs/security.md). A peer belongs to the
    first tenant it matches: the socket it came through, then its uid, then its (primary) gid. Members and
    namespaces reload; a tenant added or removed waits for a restart."""

    # Members by uid, and by (primary) gid.
    uids: list[int] = field(default_factory=list)
    gids: list[int] = field(default_factory=list)
    # A socket of its own: whoever connects through it is an engine of this tenant (the file's mode is the
    # gate), and may change nothing. Empty: members come through server.socket by uid/gid.
    socket: Path = ""
    # The namespaces its engines may open: exact names, or prefixes ending in '*'. No two tenants' overlap.
    namespaces: list[str] = field(default_factory=list)
    # Its share of L2, carved out of pool.capacity (required), a whole number of slabs; the default tenant
    # gets what is left.
    capacity: Size = 0


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    regions: RegionsConfig = field(default_factory=RegionsConfig)
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    # Directory of the file the configuration came from; relative paths resolve against it.
    base_dir: str = field(default=".", metadata={"internal": True})
    # The tables and keys the file set, as dotted paths ("storage.redis", "storage.redis.url"): a network
    # backend is used only where the file names its server, never on a default address (loader.check_backend).
    present: frozenset[str] = field(default=frozenset(), metadata={"internal": True})
