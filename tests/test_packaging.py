"""The package layout: only `hicached` is installed (connectors and config as hicached.connectors and
hicached.config), the public names sit at the top, and the import graph has no circles and no arrow from a
lower layer to a higher one."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Where each installed package's files live in the repository (pyproject's package-dir).
ROOTS = {
    "hicached": REPO / "hicached",
    "hicached.connectors": REPO / "connectors",
    "hicached.config": REPO / "config",
}

# Who may import whom: a module of the layer on the left imports only modules of the layers on the right
# (its own included). The engine runs in the engine's process and never loads the daemon side; the
# connectors are usable alone with the shared code and the configuration below them.
ALLOWED = {
    "hicached.config": ("hicached.config",),
    "hicached.common": ("hicached.common",),
    "hicached.connectors": ("hicached.connectors", "hicached.common", "hicached.config"),
    "hicached.engine": ("hicached.engine", "hicached.common"),
    "hicached.daemon": ("hicached.daemon", "hicached.connectors", "hicached.common", "hicached.config"),
}

# Floors inside the daemon, from the bottom: L2 (the pool, the allocator, the index, a page's life) imports
# nothing else of the daemon, the scheduler only L2; the rest (persist: L2 kept over restarts and the warm
# list; regions; server; service) sits above both. What a higher floor must hear from a lower one (the slot
# headers, told of every page's move) is handed down as a callback when the lower one is built.
DAEMON_FLOORS = ("hicached.daemon.l2", "hicached.daemon.sched")


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name, from the repository's folders."""
    out: dict[str, Path] = {}
    for pkg, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The hicached modules `name` imports, anywhere in it (functions and TYPE_CHECKING blocks included).
    `from pkg import x` imports module pkg.x where there is one, else a name of pkg."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.update(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names)
    return {m for m in found if m in mods and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _layer(module: str) -> str | None:
    return next((layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")), None)


def test_no_module_imports_a_layer_above_it(graph: dict[str, set[str]]) -> None:
    wrong = []
    for mod, deps in graph.items():
        layer = _layer(mod)
        if layer is None:
            continue  # hicached itself, hicached.cli and __main__: the front doors, they may use anything
        wrong += [
            f"{mod} -> {d}" for d in sorted(deps) if _layer(d) not in ALLOWED[layer] and d != "hicached"
        ]
        # `hicached` itself (the lazy public names) pulls in the engine side: no layer below it imports it.
        wrong += [f"{mod} -> hicached (the top package's names)" for d in deps if d == "hicached"]
    assert not wrong, "imports against the layering:\n  " + "\n  ".join(wrong)


def _floor(module: str) -> int:
    """A daemon module's floor: its index in DAEMON_FLOORS, or above them all."""
    return next(
        (i for i, pkg in enumerate(DAEMON_FLOORS) if module == pkg or module.startswith(pkg + ".")),
        len(DAEMON_FLOORS),
    )


def test_no_daemon_module_imports_a_floor_above_it(graph: dict[str, set[str]]) -> None:
    wrong = [
        f"{mod} -> {d}"
        for mod, deps in graph.items()
        if _layer(mod) == "hicached.daemon"
        for d in sorted(deps)
        if _layer(d) == "hicached.daemon" and _floor(d) > _floor(mod)
    ]
    assert not wrong, (
        "imports against the daemon's floors (l2 below sched below the rest):\n  " + "\n  ".join(wrong)
    )


def test_the_import_graph_has_no_circles(graph: dict[str, set[str]]) -> None:
    # Tarjan's strongly connected components; a component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_nothing_imports_config_or_connectors_as_top_level_names() -> None:
    wrong = []
    for folder in ("hicached", "connectors", "config", "tests", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                wrong += [
                    f"{path.relative_to(REPO)}:{node.lineno}: {n}"
                    for n in names
                    if n.split(".")[0] in ("config", "connectors")
                ]
    assert not wrong, "\n".join(wrong)


def test_pyproject_installs_every_package_of_the_tree_and_nothing_else() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert set(meta["packages"]) == found
    assert meta["package-dir"] == {"hicached.connectors": "connectors", "hicached.config": "config"}
    assert all(p == "hicached" or p.startswith("hicached.") for p in meta["packages"])


def test_every_package_says_what_lives_there() -> None:
    for name, path in _modules().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc) > 80, f"{name} has no docstring saying what lives there"


# The installed package, seen from a fresh interpreter outside the checkout (so that neither the working
# directory nor pytest's paths can supply `config` or `connectors`).
PROBE = """
import importlib, json, sys
out = {}
for name in ("config", "connectors", "hicached.config", "hicached.connectors", "hicached.connectors.file",
             "hicached.common._pageio", "hicached.engine.sglang", "hicached.daemon.service.lifecycle"):
    try:
        importlib.import_module(name)
        out[name] = "ok"
    except ImportError as e:
        out[name] = f"ImportError: {e}"
import hicached
from hicached import AsyncClient, Client, HicachedError, page_keys, shared_buffer
out["public"] = [Client.__module__, AsyncClient.__module__, HicachedError.__module__, page_keys.__module__,
                 shared_buffer.__module__]
out["file"] = hicached.__file__
import hicached.config
out["data"] = sorted(__import__("os").listdir(hicached.config.__path__[0]))
print(json.dumps(out))
"""


def _probe(tmp_path: Path, env: dict[str, str]) -> dict:
    import json

    r = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _check(out: dict) -> None:
    assert out["config"].startswith("ImportError") and out["connectors"].startswith("ImportError")
    for name in (
        "hicached.config",
        "hicached.connectors",
        "hicached.connectors.file",
        "hicached.common._pageio",
        "hicached.engine.sglang",
        "hicached.daemon.service.lifecycle",
    ):
        assert out[name] == "ok", (name, out[name])
    assert out["public"] == [
        "hicached.engine.client",
        "hicached.engine.async_client",
        "hicached.common.errors",
        "hicached.common.keys",
        "hicached.engine.regions",
    ]
    assert {"hicached.service", "hicached.toml"} <= set(out["data"])


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}


def test_the_installed_package_as_this_environment_has_it(tmp_path: Path) -> None:
    """The install the suite runs on (pip install -e . in CI, the README's set-up)."""
    _check(_probe(tmp_path, _clean_env()))


@pytest.mark.timeout(600)
def test_a_normal_install_has_only_hicached_at_the_top(tmp_path: Path) -> None:
    """`pip install .` (a wheel built from this tree) into a folder of its own: the only top-level name
    it adds is hicached, and the connectors, the configuration (with its data files) and the compiled page
    I/O import from inside it."""
    target = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-compile",
            "--target",
            str(target),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    top = {
        p.name
        for p in target.iterdir()
        if not p.name.endswith((".dist-info", ".egg-info")) and p.name != "bin"
    }
    assert top == {"hicached"}, top
    assert not [p for p in target.rglob("*") if p.suffix in (".c", ".h")], "C sources go in the sdist only"
    env = _clean_env()
    env["PYTHONPATH"] = str(target)  # ahead of the environment's own (editable) install
    out = _probe(tmp_path, env)
    assert out["file"] == str(target / "hicached" / "__init__.py")
    _check(out)
