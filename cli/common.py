"""Helpers shared by the CLI commands: errors without tracebacks, sizes and durations."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from tiercache.resources import default_config

DEFAULT_CONFIG = default_config()

EXIT_OK, EXIT_FINDING, EXIT_USAGE = 0, 1, 2


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """Print ``tiercache: error: message`` to stderr and exit with ``code`` (no traceback)."""
    typer.echo(f"tiercache: error: {message}", err=True)
    raise typer.Exit(code)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit s, m, h, d or w (``30m``, ``7d``).

    Raises:
        typer.BadParameter: anything else.
    """
    m = _DURATION.match(text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a duration: use a number with s, m, h, d or w (e.g. 30m, 7d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def resolve_root(root: Path | None, config: Path | None) -> Path:
    """The root named by ``--root``, else by ``--config`` (default config if neither)."""
    if root is not None:
        return root
    from tiercache.config import load_config
    from tiercache.errors import TierCacheError

    try:
        return load_config(config or DEFAULT_CONFIG).root
    except TierCacheError as exc:
        fail(str(exc))


def roots_inside(root: Path) -> list[Path]:
    """The tiercache roots directly inside ``root`` (sorted): ``tiercache bench --keep`` leaves
    its files in ``ROOT/bench-<time>-<pid>/``, and vLLM's ``TierCacheTier`` keeps one root per
    model and rank in ``ROOT/<model>_<digest>_r<rank>/``."""
    from tiercache.rootops import is_root

    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and is_root(p))
    except OSError:
        return []


def not_a_root(root: Path) -> str:
    """Why ``root`` is not a tiercache root, naming the roots directly inside it (a sentence)."""
    inside = roots_inside(root)
    if inside:
        more = f" and {len(inside) - 5} more" if len(inside) > 5 else ""
        return (f"{str(root)!r} is not a tiercache root itself (no .tiercache-root marker) but holds tiercache "
                f"roots: {', '.join(str(p) for p in inside[:5])}{more}; give one of them")
    return f"{str(root)!r} is not a tiercache root (no .tiercache-root marker)"


def array_members(root: Path) -> list[Path]:
    """The roots to work on for ``root``: itself, or every member of its root array (the home
    first), as the array's record names them; a member whose path is gone is an error."""
    from tiercache.errors import RootError
    from tiercache.rootops import members_of

    try:
        members = members_of(root)
    except RootError as exc:
        fail(str(exc))
    gone = [str(m) for m in members if not m.is_dir()]
    if gone:
        fail(f"{str(root)!r} is a member of a root array whose member(s) {', '.join(gone)} are missing: mount them, "
             "or take them out with `tiercache roots remove ... --forget ROOT`")
    return members
