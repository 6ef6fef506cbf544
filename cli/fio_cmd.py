"""The fio-style side of ``tiercache bench``: options and job files -> jobs -> fio-like output."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from tiercache import __version__
from tiercache.bench.fiorun import format_fio, merge_passes, plot, run_job
from tiercache.bench.fiospec import job_from_options, load_job_file
from tiercache.config import load_config
from tiercache.errors import TierCacheError

from .common import DEFAULT_CONFIG, EXIT_FINDING, fail


def run_fio(jobfiles: list[Path], overrides: dict, config: Path | None, root: Path | None, as_json: bool,
            plot_path: Path | None, repeat: int = 1) -> None:
    """Run the jobs of ``jobfiles`` (or one job from the command-line options) and print them;
    ``repeat`` alternated passes of each (tiercache, then its baseline), merged at the median
    ratio."""
    try:
        cfg = load_config(config or DEFAULT_CONFIG, root=root)
        if jobfiles:
            jobs = [j for f in jobfiles for j in load_job_file(f, overrides)]
        else:
            jobs = [job_from_options("cli", overrides)]
        log = (lambda s: None) if as_json else (lambda s: typer.echo(s, err=True))
        records = []
        for job in jobs:
            log(f"  ... {job.name}")
            records.append(merge_passes([run_job(job, cfg.root, config_pool=cfg.pools[0], io_threads=cfg.io_threads,
                                                 log=log) for _ in range(repeat)]))
        if plot_path is not None:
            plot(records, plot_path)
    except TierCacheError as exc:
        fail(str(exc))
    except RuntimeError as exc:  # a transfer or verification failure: a finding
        fail(str(exc), EXIT_FINDING)
    if as_json:
        typer.echo(json.dumps({"fio version": f"tiercache-{__version__}", "jobs": records}, indent=2))
    else:
        typer.echo(format_fio(records))
