"""The operator's levers on a running daemon (`hicached ctl`): reload (re-read the configuration file and
apply what can change live), backend show/attach/detach, drain, flush and status."""

from __future__ import annotations

import logging
import os
from typing import Any

from hicached import config
from hicached.common.errors import BAD_REQUEST, HicachedError
from hicached.config import Config
from hicached.config.diff import plan
from hicached.connectors import BackendError

log = logging.getLogger("hicached.daemon")

# `daemon` below is a hicached.daemon.service.lifecycle.Daemon (not imported: the lifecycle imports this
# module).


async def reload(daemon: Any) -> dict[str, Any]:
    """Re-read the configuration file and apply what can change live. Whatever fails, the daemon keeps
    running with the configuration it had, says why (the answer, `ctl status`, the systemd status line)
    and sends READY=1 after its RELOADING=1."""
    async with daemon._reload_lock:
        daemon.notifier.reloading()
        try:
            result = await _reload(daemon)
        except (config.ConfigError, BackendError, HicachedError, OSError) as e:
            result = _rejected(daemon, str(e))
        except Exception as e:
            # A bug rather than a bad file: logged with its traceback, and still a refusal, so that the
            # daemon goes on serving with what it had and systemd hears READY=1.
            result = _rejected(daemon, f"unexpected {type(e).__name__}: {e}", exc_info=True)
        finally:
            daemon.notifier.ready(daemon.status_line())
        return result


def _rejected(daemon: Any, reason: str, exc_info: bool = False) -> dict[str, Any]:
    daemon.reloads["rejected"] += 1
    daemon.last_reload = f"rejected: {reason}"
    log.error("reload rejected, keeping the running configuration: %s", reason, exc_info=exc_info)
    return {"ok": False, "reason": reason}


async def _reload(daemon: Any) -> dict[str, Any]:
    if not daemon.config_path:
        raise HicachedError(BAD_REQUEST, "the daemon was not started from a configuration file")
    new = config.load(daemon.config_path)
    p = plan(daemon.cfg, new)
    old = daemon.cfg
    try:
        apply(daemon, p.config)
        if p.swap_backend:
            await daemon._attach_configured()
    except BaseException:
        apply(daemon, old)  # a refusal leaves nothing of the new file applied
        if p.swap_backend:
            daemon.tiers.counters["backend.swap_failures"] += 1
        raise
    if p.swap_backend:
        daemon.tiers.counters["backend.swaps"] += 1
    was, now = old.warmup, daemon.cfg.warmup
    if (was.enabled, was.snapshot_interval) != (now.enabled, now.snapshot_interval):
        daemon.warm.follow_snapshot_interval()
    if p.restart:
        log.warning("reload: %s changed but need a restart; kept as they were", ", ".join(p.restart))
    daemon.reloads["ok"] += 1
    daemon.last_reload = "ok" + (f" (restart needed for {', '.join(p.restart)})" if p.restart else "")
    log.info("reload applied: %s", ", ".join(p.live) or "nothing changed")
    return {
        "ok": True,
        "applied": p.live,
        "restart_required": p.restart,
        "backend": daemon.tiers.backend.name,
    }


def apply(daemon: Any, cfg: Config) -> None:
    """Point every part at `cfg` and adjust what runs (workers, policy, log level)."""
    was_write_back = daemon.tiers.write_back
    daemon.cfg = cfg
    daemon.tiers.cfg = cfg
    daemon.tiers.retenant()  # namespaces that moved to another tenant leave the old one's pool
    daemon.server.cfg = cfg
    daemon.tiers.backend.cfg = cfg
    st = cfg.storage
    b = daemon.tiers.backup
    b.batch_pages, b.batch_bytes, b.queue_pages = (
        st.backup_batch_pages,
        st.backup_batch_bytes,
        st.backup_queue_pages,
    )
    b.backoff = b.backoff.from_config(st.retry)
    b.resize(st.backup_concurrency)
    pf = daemon.tiers.prefetcher
    pf.batch_pages, pf.batch_bytes = st.prefetch_batch_pages, st.prefetch_batch_bytes
    pf.queue_pages = st.prefetch_queue_pages
    pf.resize(st.prefetch_concurrency)
    daemon.tiers.set_policy(was_write_back)
    logging.getLogger().setLevel(cfg.logging.level.upper())


def handlers(daemon: Any) -> dict[str, Any]:
    """The operator commands (hicached ctl) the server answers through the daemon."""

    async def reload(session, req) -> dict:
        return await daemon.reload()

    async def backend(session, req) -> dict:
        action = req.get("action", "show")
        if action == "show":
            return daemon.tiers.backend.stats()
        if action == "detach":
            await daemon.tiers.backend.attach(None)
            daemon.tiers.counters["backend.swaps"] += 1
            log.info("backend detached by ctl: serving from L2 only")
            return daemon.tiers.backend.stats()
        if action == "attach":
            await daemon._attach_named(req.get("name"))
            return daemon.tiers.backend.stats()
        raise HicachedError(BAD_REQUEST, f"unknown backend action {shown(action)}: show, attach or detach")

    async def drain(session, req) -> dict:
        if req.get("cancel"):
            daemon.server.draining = False
            return {"draining": False}
        daemon.server.draining = True
        return {"draining": True, **await daemon.tiers.flush(daemon.cfg.shutdown.flush_timeout)}

    async def flush(session, req) -> dict:
        return await daemon.tiers.flush(daemon.cfg.shutdown.flush_timeout)

    return {
        "reload": reload,
        "backend": backend,
        "drain": drain,
        "flush": flush,
        "status": lambda session, req: daemon.status(),
    }


def status(daemon: Any) -> dict[str, Any]:
    out = daemon.server.status() if daemon.server else {}
    out.update(
        {
            "backend_state": daemon.tiers.backend.state,
            "last_reload": daemon.last_reload,
            "reloads": dict(daemon.reloads),
            "config": daemon.config_path or "",
        }
    )
    backend = daemon.tiers.backend.stats()
    if "why" in backend:  # not attached: why, and since when (a stall, failures, ctl, not started yet)
        out["backend_why"] = backend["why"]
        out["backend_since"] = backend.get("since", "")
    return out


def status_line(daemon: Any) -> str:
    """One line for `systemctl status`. The outcome of the last reload comes last: a long reason is what
    the notifier cuts, not the figures."""
    idx = daemon.tiers.index
    used = idx.used_bytes()
    pct = 100.0 * used / idx.capacity
    return (
        f"backend {daemon.tiers.backend.configured} ({daemon.tiers.backend.state}); "
        f"pool {pct:.0f}% of {idx.capacity >> 20} MiB, {len(idx.entries)} pages; "
        f"pid {os.getpid()}; last reload: {daemon.last_reload}"
    )


def shown(value: Any, limit: int = 80) -> str:
    """repr of a value from a request, cut short: an answer does not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
