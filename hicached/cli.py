"""The `hicached` command: serve, check-config, ctl."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from hicached import config

DEFAULT_CONFIG = "hicached.toml"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _load(path: str) -> config.Config:
    try:
        return config.load(path)
    except config.ConfigError as e:
        print(f"hicached: invalid configuration: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from hicached.daemon.service.lifecycle import Daemon
    from hicached.daemon.service.notify import listen_socket

    cfg = _load(args.config)
    _setup_logging(cfg.logging.level)
    daemon = Daemon(cfg, config_path=os.path.abspath(args.config))
    try:
        uvloop.run(daemon.run(listen_socket()))
    except RuntimeError as e:
        logging.getLogger("hicached").error("%s", e)
        return 1
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args.path)
    print(f"{args.path}: OK (backend {cfg.storage.backend}, pool {cfg.pool.capacity} bytes)")
    return 0


def _socket_path(args: argparse.Namespace) -> str:
    if args.socket:
        return args.socket
    cfg_path = args.config or DEFAULT_CONFIG
    if not os.path.exists(cfg_path):
        return config.resolve_path(config.Config(), config.Config().server.socket)
    try:
        # Only server.socket is read: a file the daemon would refuse still says where it listens, so that
        # `ctl reload` reaches the daemon and prints its reason for refusing the file.
        return config.socket_path(cfg_path)
    except config.ConfigError as e:
        print(f"hicached ctl: cannot read the daemon's socket from {cfg_path}: {e}", file=sys.stderr)
        print("hicached ctl: name it with --socket", file=sys.stderr)
        raise SystemExit(2) from None


_CTL_WAIT_S = 60.0
_FLUSH_WAIT_S = 3600.0  # longer than any sane shutdown.flush_timeout: the daemon answers when it is done


def cmd_ctl(args: argparse.Namespace) -> int:
    from hicached.common.errors import HicachedError
    from hicached.engine.client import control

    extra: dict = {}
    words = args.args
    if args.cmd == "backend":
        action = words[0] if words else "show"
        if action not in ("show", "attach", "detach") or (action != "attach" and len(words) > 1):
            print("hicached ctl: usage: ctl backend show | attach [file|redis|s3] | detach", file=sys.stderr)
            return 2
        extra = {"action": action, **({"name": words[1]} if len(words) > 1 else {})}
    elif args.cmd == "drain":
        if words not in ([], ["cancel"]):
            print("hicached ctl: usage: ctl drain [cancel]", file=sys.stderr)
            return 2
        extra = {"cancel": bool(words)}
    elif words:
        print(f"hicached ctl: {args.cmd} takes no arguments", file=sys.stderr)
        return 2
    try:
        timeout = args.timeout or (_FLUSH_WAIT_S if args.cmd in ("flush", "drain") else _CTL_WAIT_S)
        answer = control(_socket_path(args), args.cmd, timeout=timeout, **extra)
    except HicachedError as e:
        print(f"hicached ctl: {e}", file=sys.stderr)
        return 1
    answer.pop("id", None)
    try:
        if args.json:
            print(json.dumps(answer, indent=2, sort_keys=True))
        else:
            _print_human(answer)
        sys.stdout.flush()
    except BrokenPipeError:  # `hicached ctl stats | head`: the reader went away, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.cmd == "reload" and answer.get("ok") is False:
        reason = answer.get("reason")
        print(f"hicached ctl: reload rejected, the daemon keeps its configuration: {reason}", file=sys.stderr)
    # A reload rejected, or a flush or drain that did not write every page to L3 in time: scripts see it.
    return 1 if answer.get("ok") is False or answer.get("flushed") is False else 0


def _print_human(d: dict, indent: int = 0) -> None:
    for k in sorted(d):
        v = d[k]
        if isinstance(v, dict):
            print(" " * indent + f"{k}:")
            _print_human(v, indent + 2)
        else:
            print(" " * indent + f"{k}: {v}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicached", description="Tiered KV-cache daemon for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "serve",
        help="run the daemon in the foreground (taking over from one that serves the same socket)",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help="TOML configuration (default: ./hicached.toml)")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("check-config", help="validate a configuration file")
    p.add_argument("path", nargs="?", default=DEFAULT_CONFIG, help="default: ./hicached.toml, as serve reads")
    p.set_defaults(fn=cmd_check_config)
    p = sub.add_parser("ctl", help="ask a running daemon")
    p.add_argument("--socket", help="the daemon's socket (default: from --config or ./hicached.toml)")
    p.add_argument("--config", help="read the socket path from this configuration")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds to wait for the answer (default 60; for flush and drain, which the daemon bounds "
        "with shutdown.flush_timeout itself, 3600)",
    )
    p.add_argument("cmd", choices=["status", "stats", "reload", "backend", "drain", "flush"])
    p.add_argument("args", nargs="*", help="backend: show | attach [file|redis|s3] | detach; drain: [cancel]")
    p.set_defaults(fn=cmd_ctl)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
