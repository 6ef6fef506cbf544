"""The package's layers, read from the source with ``ast`` (nothing is imported).

docs/architecture.md draws these layers; this file holds the code to them:

- no import circle between modules (lazy imports inside functions count too);
- every import between two units goes down the layer order below (a unit is a subpackage, or
  one of the groups of top-level modules);
- a unit takes another subpackage's names from the subpackage itself (its ``__init__`` says
  what it offers), never from a module inside it, and never a name starting with ``_``;
- nothing in the library imports the benchmarks; the scripts under ``benchmarks/`` use public
  names only and each reproduces a claim that a page under docs/ or README.md makes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: folders of the repository and the package each one is installed as (pyproject.toml's package-dir)
SOURCES = {
    "tiercache": "tiercache",
    "cli": "tiercache.cli",
    "kernels": "tiercache.kernels",
    "configs": "tiercache.configs",
}
FOUNDATION = ("errors", "keys", "dtypes", "geometry", "cuda", "arrays", "settings", "resources")
FACADE = ("__init__", "cache", "rowstore", "aio", "config", "metrics")
#: bottom to top: a unit may import units of lower layers only (and itself)
LAYERS = [
    ["foundation", "tiercache.kernels", "tiercache.configs"],
    ["tiercache.memory"],
    ["tiercache.copypaths", "tiercache.files"],
    ["tiercache.rootops"],
    ["tiercache.transfer"],
    ["tiercache.placement"],
    ["tiercache.moves"],
    ["tiercache.enginetensors"],
    ["facade"],
    ["tiercache.integrations"],
    ["tiercache.bench"],
    ["tiercache.cli"],
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in SOURCES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = path
    return mods


MODULES = _modules()
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def unit_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and f"tiercache.{parts[1]}" in RANK:
        return f"tiercache.{parts[1]}"
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in FOUNDATION:
        return "foundation"
    if top in FACADE:
        return "facade"
    raise AssertionError(f"module {module} belongs to no layer: add it to LAYERS in {__file__}")


def imports_of(module: str) -> list[tuple[str, str, int]]:
    """``(target module, name, line)`` for every import of ``tiercache`` in ``module``; ``name``
    is the imported name ('' for ``import x``). A name that is a submodule targets it."""
    path = MODULES[module]
    package = module if module in PACKAGES else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "tiercache"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "tiercache":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in MODULES else target, a.name, node.lineno))
    return out


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(REPO)}:{line}"


def test_every_module_has_a_layer():
    assert {unit_of(m) for m in MODULES} <= set(RANK)
    assert len(MODULES) > 40


def test_no_import_circle():
    graph = {m: sorted({t for t, _, _ in imports_of(m) if t in MODULES and t != m}) for m in MODULES}
    # Tarjan's strongly connected components
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_imports_go_down_the_layers():
    bad = []
    for m in MODULES:
        for target, _, line in imports_of(m):
            if target not in MODULES:
                continue
            src, dst = unit_of(m), unit_of(target)
            if src != dst and RANK[dst] >= RANK[src]:
                bad.append(f"{_where(m, line)}: {src} imports {target} ({dst}, not below it)")
    assert not bad, "\n".join(bad)


def test_library_never_imports_the_benchmarks():
    bad = [f"{_where(m, line)}: {target}" for m in MODULES if unit_of(m) not in ("tiercache.bench", "tiercache.cli")
           for target, _, line in imports_of(m) if target.startswith("tiercache.bench")]
    assert not bad, "\n".join(bad)


def test_the_cli_reaches_roots_through_rootops_only():
    """The commands parse, ask and print; the rules about a root's files (what is bad, what is
    the cache's to delete, locks) live in tiercache.rootops, and the CLI never imports the file
    tier's modules itself."""
    bad = [f"{_where(m, line)}: {target}" for m in MODULES if unit_of(m) == "tiercache.cli"
           for target, _, line in imports_of(m) if target.startswith("tiercache.files")]
    assert not bad, "\n".join(bad)


def test_subpackages_are_used_through_their_faces_and_no_private_names_cross():
    # an integration module is a face of its own: it imports its library (transformers...), so
    # its package cannot import it for everyone
    faces = {u for u in RANK if u.startswith("tiercache.") and u in PACKAGES} - {"tiercache.bench", "tiercache.cli",
                                                                                 "tiercache.kernels",
                                                                                 "tiercache.integrations"}
    bad = []
    for m in MODULES:
        for target, name, line in imports_of(m):
            src, dst = unit_of(m), unit_of(target) if target in MODULES else None
            if dst is None or src == dst:
                continue
            if name.startswith("_") and not name.endswith("__"):
                bad.append(f"{_where(m, line)}: private name {name} from {target}")
            if dst in faces and target != dst:
                bad.append(f"{_where(m, line)}: {target} is inside {dst}: import {name or target} from {dst}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_face_offers_what_it_names(package):
    """Every name in a subpackage's ``__all__`` is bound by its ``__init__``."""
    tree = ast.parse(MODULES[package].read_text())
    bound = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    bound |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), [])
    assert set(names) <= bound
    assert ast.get_docstring(tree), f"{package} has no docstring saying what the layer is"


def test_benchmark_scripts_use_public_names_and_back_a_documented_claim():
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").rglob("*.md")])
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    for path in scripts:
        assert f"benchmarks/{path.name}" in docs, f"{path.name} backs no claim in docs/ or README.md"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tiercache"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
                assert not private, f"{path.name}:{node.lineno} imports private {private} from {node.module}"


def test_every_subpackage_is_packaged():
    """pyproject.toml names every package folder (a folder left out is missing from a wheel
    install, while an editable install still finds it)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {m for m in PACKAGES if m.startswith("tiercache.")} | {"tiercache"}
    assert folders <= listed, sorted(folders - listed)


def test_every_measured_file_backs_a_page():
    """Evidence lives in docs/measured/ and every file there is cited by a page (by its path,
    its name, or a pattern such as ``measured/vllm/connector-*-20261127.json``): no data
    beside the prose, none that no page explains."""
    import fnmatch
    import re

    assert not [p.name for p in (REPO / "docs").iterdir() if p.is_file() and p.suffix != ".md"], \
        "data files belong under docs/measured/"
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").rglob("*.md")])
    cited = {c.split("measured/", 1)[-1] for c in re.findall(r"[\w.*/-]+\.(?:json|txt|png)", text)}
    uncited = []
    for path in sorted((REPO / "docs" / "measured").rglob("*")):
        if path.is_file():
            rel = str(path.relative_to(REPO / "docs" / "measured"))
            if not any(fnmatch.fnmatch(rel, c) or fnmatch.fnmatch(path.name, c) for c in cited):
                uncited.append(rel)
    assert not uncited, f"cited by no page: {uncited}"


def test_measured_files_are_named_by_subject_job_machine_and_date():
    """``docs/measured/<subject>/<job>-<machine>-<YYYYMMDD>[-what it holds].<ext>``: one folder
    per subject, and a name that says which job ran where and when."""
    import re

    pattern = re.compile(r"[a-z]+/[a-z-]+-(cpu|h100|h200|h100x2|2xh200)-2026\d{4}(-[\w.-]+)?\.(json|txt|png)")
    bad = [str(p.relative_to(REPO / "docs" / "measured")) for p in (REPO / "docs" / "measured").rglob("*")
           if p.is_file() and not pattern.fullmatch(str(p.relative_to(REPO / "docs" / "measured")))]
    assert not bad, f"named outside the convention: {bad}"


def test_pages_stay_short_and_their_links_resolve():
    """README.md at most 300 lines and no page under docs/ over 600; every relative link of a
    page names a file of the repository (no link outside it)."""
    import re

    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    long = {str(p.relative_to(REPO)): n for p in pages
            if (n := len(p.read_text().splitlines())) > (300 if p.name == "README.md" and p.parent == REPO else 600)}
    assert not long, f"pages too long: {long}"
    broken = []
    for p in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", p.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (p.parent / target.split("#", 1)[0]).resolve()
            if not path.exists() or REPO.resolve() not in path.parents:
                broken.append(f"{p.relative_to(REPO)} -> {target}")
    assert not broken, f"links that resolve to nothing in the repository: {broken}"
