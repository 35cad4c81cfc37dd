"""The configuration reference, docs/configuration.md, generated from the schema: its sections, keys, types
and defaults, the comments written beside each key in schema.py, and the bounds the loader checks.

    python -m hicached.config.reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from typing import Any, Literal, get_args, get_origin

from . import loader, schema, tenants
from .diff import RESTART_REQUIRED
from .units import exact_duration, exact_size

COMMAND = "python -m hicached.config.reference > docs/configuration.md"
WIDTH = 110

INTRO = f"""\
# Configuration

<!-- Generated from config/schema.py by `{COMMAND}`:
edit the schema's comments, not this page; tests/config/test_reference.py fails when the two disagree. -->

Everything lives in one TOML file (`hicached.toml` here; the schema with every default and bound is
`config/schema.py`). Sizes are written `"512MiB"`, `"4GiB"`; durations `"500ms"`, `"5s"`; relative paths
resolve against the directory of the file. Unknown keys and bad values are refused with the key path:

```sh
hicached check-config                  # ./hicached.toml, the file `hicached serve` reads; or give a path
hicached check-config /etc/hicached/hicached.toml
```

A file is refused as a whole, with its reason, by `serve` and `check-config` (exit 2) and by a reload
(see [Reloading](operations.md#reloading-and-swapping-backends)), when it is empty, only white space or
only comments (the daemon never runs on the built-in defaults because its file was truncated: write at
least one setting, `[storage] backend = "file"` say);
holds bytes that are not UTF-8 (the line and column are named); cannot be read, or is a directory or
another thing than a regular file; is larger than 1 MiB; or is not valid TOML. Integers past 64 bits are
refused, and so are `storage.backup_concurrency`, `prefetch_concurrency` and `storage.file.io_threads` past
1024 (each is a task or a thread that a reload starts at once). A `redis` or `s3` backend is used only where
the file names its store: its section, with `url` (Redis) or `bucket` (S3) set in it
(see [Backends](operations.md#backends)); the `file` backend keeps its default root, `data`.

`pool.capacity` (and each tenant's `capacity`) must be a whole number of `pool.slab_size` slabs: L2 holds
whole slabs only, and the loader refuses a size between two, naming the nearest it would take. Sizes and
durations cannot be negative. A key marked *restart* keeps its running value on a reload (the reload
reports it); a restart applies it. A reload applies the rest live
([operations.md](operations.md#reloading-and-swapping-backends)).
"""


def render() -> str:
    comments = _comments(inspect.getsource(schema))
    bounds = _bounds()
    out = [INTRO]
    for f in _fields(schema.Config):
        hint = _hints(schema.Config)[f.name]
        if dataclasses.is_dataclass(hint):
            _section(out, hint, f.name, comments, bounds)
        elif get_origin(hint) is dict:
            _section(out, get_args(hint)[1], f"{f.name}.NAME", comments, bounds)
    return "\n".join(out).rstrip() + "\n"


def _section(out: list[str], cls: type, path: str, comments: dict, bounds: dict[str, list[str]]) -> None:
    out.append(f"## [{path}]\n")
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        out.append(_wrap(inspect.cleandoc(cls.__doc__)) + "\n")
    nested = []
    for f in _fields(cls):
        hint = _hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            nested.append((hint, f"{path}.{f.name}"))
            continue
        key = f"{path}.{f.name}".replace(".NAME.", ".*.")
        head = f"`{f.name}` ({_type(hint)}, default {_default(hint, _default_value(f))})"
        notes = [*bounds.get(key, [])]
        if _needs_restart(key):
            notes.append("*restart*")
        head += (": " + "; ".join(notes) if notes else "") + "."
        text = " ".join([head, *comments.get((cls, f.name), [])])
        out.append(_wrap(text, "- "))
    out.append("")
    for cls_, sub in nested:
        _section(out, cls_, sub, comments, bounds)


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _default_value(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _type(hint: Any) -> str:
    if get_origin(hint) is typing.Annotated:
        marker = get_args(hint)[1]
        return {"size": "size", "duration": "duration", "mode": "octal mode", "path": "path"}[marker]
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(f'`"{c}"`' for c in get_args(hint))
    if get_origin(hint) is list:
        return f"list of {_type(get_args(hint)[0])}s"
    return {int: "integer", float: "number", bool: "boolean", str: "string"}[hint]


def _default(hint: Any, value: Any) -> str:
    marker = get_args(hint)[1] if get_origin(hint) is typing.Annotated else None
    if marker == "size":
        return f'`"{exact_size(value)}"`' if value else "`0`"
    if marker == "duration":
        return f'`"{exact_duration(value)}"`' if value else "`0`"
    if marker == "mode":
        return f'`"{value:04o}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def _needs_restart(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in RESTART_REQUIRED)


def _comments(source: str) -> dict[tuple[type, str], list[str]]:
    """(class, field) -> the comment block written right above the field in schema.py, and one at its end."""
    lines: dict[int, str] = {}
    own_line: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                own_line.add(tok.start[0])
    out: dict[tuple[type, str], list[str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or not hasattr(schema, node.name):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                n, block = item.lineno - 1, []
                while n in own_line:
                    block.insert(0, lines[n])
                    n -= 1
                if item.lineno in lines and item.lineno not in own_line:
                    block.append(lines[item.lineno])
                if block:
                    out[(getattr(schema, node.name), item.target.id)] = block
    return out


def _bounds() -> dict[str, list[str]]:
    """Key -> the bounds validate() and check_tenants() refuse values with, read from their code: the keys
    given to _positive and _at_most, and the constant messages of ConfigError("key", ...)."""
    out: dict[str, list[str]] = {}
    for fn in (loader.validate, tenants.check_tenants):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            args = node.args
            if node.func.id == "_positive" and all(isinstance(a, ast.Constant) for a in args[1:]):
                for name in args[2:]:
                    _add(out, f"{args[1].value}.{name.value}", "more than 0")
            elif node.func.id == "_at_most" and all(isinstance(a, ast.Constant) for a in args[3:]):
                bound = getattr(schema, args[2].id) if isinstance(args[2], ast.Name) else args[2].value
                for name in args[3:]:
                    _add(out, f"{args[1].value}.{name.value}", f"at most {bound}")
            elif node.func.id == "whole_slabs" and _key(args[0]):
                _add(out, _key(args[0]), "a whole number of slabs (pool.slab_size)")
            elif node.func.id == "ConfigError" and len(args) == 2:
                key, message = _key(args[0]), _message(args[1])
                if key and message:
                    _add(out, key, message)
    return out


def _add(out: dict[str, list[str]], key: str, text: str) -> None:
    if text not in out.setdefault(key, []):
        out[key].append(text)


def _key(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant):
        return node.value
    # f"{at}.capacity" in check_tenants, where at = f"tenants.{name}"
    if isinstance(node, ast.JoinedStr) and len(node.values) == 2:
        first, rest = node.values
        if isinstance(first, ast.FormattedValue) and ast.unparse(first.value) == "at":
            return "tenants.*" + rest.value  # type: ignore[attr-defined]
    return None


def _message(node: ast.expr) -> str | None:
    """The words of a refusal that states a bound ("must ...", "is required ..."), without what is computed at
    run time: the value got, and parenthesised figures."""
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
    elif isinstance(node, ast.Constant):
        text = node.value
    else:
        return None
    text = re.sub(r" \([^()]*\0[^()]*\)|, got .*", "", text)
    if "\0" in text or not text.startswith(("must", "is required")):
        return None
    return text


def _wrap(text: str, bullet: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=bullet, subsequent_indent=" " * len(bullet))


if __name__ == "__main__":
    sys.stdout.write(render())
