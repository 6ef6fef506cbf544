"""``tiercache``: run the main job and benchmarks, inspect and clean file tiers.

Exit codes: 0 success, 1 a finding (bytes that did not verify), 2 a usage or configuration
error (reported in one line, no traceback).
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from tiercache.errors import TierCacheError


def _is(exc: BaseException, name: str) -> bool:
    """``exc`` is click's exception ``name`` (click's own, or the copy newer typers vendor)."""
    return any(c.__name__ == name for c in type(exc).__mro__)


def one_line(exc: Exception) -> str:
    """A click usage error as one line: the command, what was wrong, where help is."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "tiercache"
    text = " ".join(exc.format_message().split())
    return f"tiercache: error: {where}: {text} (see {where} --help)"


class OneLineErrors(TyperGroup):
    """Every usage error (a bad option value, an unknown option, a missing argument), whether
    typer or a command raises it, is one line on stderr with exit code 2, like the errors the
    commands report themselves; an abort (no answer to a question) is exit code 2 too, and so
    is a tiercache error or an OS error a command let through (an unreadable root, say)."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except Exception as exc:
            if _is(exc, "UsageError"):
                typer.echo(one_line(exc), err=True)
                rv = 2
            elif _is(exc, "ClickException"):
                typer.echo(f"tiercache: error: {' '.join(exc.format_message().split())}", err=True)
                rv = exc.exit_code
            elif _is(exc, "Abort"):
                typer.echo("tiercache: error: aborted", err=True)
                rv = 2
            elif isinstance(exc, (TierCacheError, OSError)):  # what a command did not report itself
                typer.echo(f"tiercache: error: {' '.join(str(exc).split())}", err=True)
                rv = 2
            else:
                raise
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    name="tiercache",
    cls=OneLineErrors,
    help="Tiered block cache (VRAM -> pinned DRAM -> NVMe files): benchmarks and tools.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)

from .bench_cmd import bench_app
from .calibrate_cmd import calibrate
from .inspect_cmd import inspect
from .purge_cmd import purge
from .roots_cmd import roots_app
from .top_cmd import top
from .verify_cmd import verify


@app.callback()
def _root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log tiercache's decisions.")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr)


app.command()(inspect)
app.command()(purge)
app.command()(verify)
app.command()(calibrate)
app.command()(top)
app.add_typer(bench_app, name="bench")
app.add_typer(roots_app, name="roots")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
