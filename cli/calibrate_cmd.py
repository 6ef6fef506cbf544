"""``tiercache calibrate``: measure where the copy engines overtake the SM kernels on this machine
and print the ``[transfer]`` thresholds to use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from tiercache.config import load_config
from tiercache.errors import TierCacheError

from .common import DEFAULT_CONFIG, EXIT_USAGE, fail


def calibrate(
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", help="TOML config: its device_id and copy_kernel_sms.")
    ] = None,
    tolerance: Annotated[
        float, typer.Option(help="Copy engines win from this share of the SM kernel's bandwidth.", min=0.5, max=1.5)
    ] = 0.97,
    quick: Annotated[bool, typer.Option(help="32 MiB per request, 3 samples (default: 128 MiB, 5).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Measure scattered blocks (16 KiB-2 MiB) and runs of consecutive slots (128 KiB-8 MiB) by the
    SM kernel and by the copy engines, both directions, on this GPU; print the table and the
    `batch_min_bytes` / `memcpy_min_bytes` lines for your config's `[transfer]` table (GPU)."""
    from tiercache.bench.calibrate import calibrate as run
    from tiercache.bench.calibrate import format_calibration

    try:
        cfg = load_config(config or DEFAULT_CONFIG)
        log = (lambda s: None) if as_json else (lambda s: typer.echo(s, err=True))
        rep = run(cfg.device_id, cfg.copy_kernel_sms, tolerance=tolerance, quick=quick, log=log)
    except TierCacheError as exc:
        if as_json:  # the error as JSON too, for scripts that parse the output
            typer.echo(json.dumps({"ok": False, "error": str(exc)}, indent=2))
            raise typer.Exit(EXIT_USAGE) from None
        fail(str(exc))
    typer.echo(json.dumps(rep, indent=2) if as_json else format_calibration(rep))
