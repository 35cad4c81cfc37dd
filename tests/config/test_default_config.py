"""The shipped configurations: hicached.toml works as it is, and its commented Redis and S3 blocks are
valid configurations once uncommented; config/hicached.toml (system paths) validates too."""

import os
import re

import pytest

from hicached import config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def uncomment(text: str, section: str, backend: str) -> str:
    lines, on = [], False
    for line in text.splitlines():
        if line.startswith(f"# [{section}]"):
            on = True
        elif on and not line.startswith("# "):
            on = False
        lines.append(line[2:] if on else line)
    out = "\n".join(lines)
    return re.sub(r'^backend = "file"', f'backend = "{backend}"', out, flags=re.M)


@pytest.mark.parametrize("section,backend", [("storage.redis", "redis"), ("storage.s3", "s3")])
def test_commented_backends_are_valid(tmp_path, section, backend):
    text = open(os.path.join(ROOT, "hicached.toml")).read()
    path = tmp_path / "c.toml"
    path.write_text(uncomment(text, section, backend))
    cfg = config.load(path)
    assert cfg.storage.backend == backend
    assert cfg.storage.redis.url.startswith("redis://") and cfg.storage.s3.bucket == "hicached"


def test_shipped_configs_load():
    cfg = config.load(os.path.join(ROOT, "hicached.toml"))
    assert cfg.storage.backend == "file" and config.resolve_path(cfg, cfg.storage.file.root).endswith("data")
    system = config.load(os.path.join(ROOT, "config", "hicached.toml"))
    assert system.server.socket == "/run/hicached/hicached.sock"
