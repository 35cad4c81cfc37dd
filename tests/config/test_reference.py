"""docs/configuration.md is generated from the schema: the committed page must be what the schema says now."""

from __future__ import annotations

from pathlib import Path

from hicached.config.diff import flatten
from hicached.config.reference import COMMAND, render
from hicached.config.schema import Config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_reference_is_the_generated_one() -> None:
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date: run {COMMAND}"


def test_every_key_is_in_the_reference_with_its_comment() -> None:
    page = render()
    sections = {key.rpartition(".")[0] for key in flatten(Config())}
    for section in sections:
        assert f"## [{section}]\n" in page
    for key in flatten(Config()):
        assert f"- `{key.rpartition('.')[2]}` (" in page
    assert "## [tenants.NAME]" in page
    # a comment block above a key, a bound read from the loader, a key a reload cannot change
    flat = page.replace("\n  ", " ")
    assert "Unit of memory handed to a size class" in flat
    assert '- `capacity` (size, default `"1GiB"`): more than 0; a whole number of slabs' in flat
    assert "- `io_threads` (integer, default `0`): at most 1024" in flat
    assert '- `eviction` (one of `"auto"`, `"slru"`, `"lru"`, default `"lru"`): *restart*.' in flat
