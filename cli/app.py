"""``tiercache``: run the main job and benchmarks, inspect and clean file tiers.

Exit codes: 0 success, 1 a finding (bytes that did not verify), 2 a usage or configuration
error (reported in one line, no traceback).
"""

from __future__ import annotations

import json
import logging
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from tiercache.bench.mainjob import format_report, run_main_job
from tiercache.config import load_config
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

from .calibrate_cmd import calibrate
from .common import DEFAULT_CONFIG
from .common import fail as _fail
from .inspect_cmd import inspect
from .purge_cmd import purge
from .top_cmd import top
from .verify_cmd import verify


class OutputFormat(str, Enum):
    normal = "normal"
    json = "json"


class Job(str, Enum):
    main = "main"
    copy = "copy"
    file = "file"
    layerwise = "layerwise"
    metrics = "metrics"
    shared = "shared"
    hf = "hf"
    vllm_tier = "vllm-tier"
    vllm_serve = "vllm-serve"
    scale = "scale"


class Baseline(str, Enum):
    auto = "auto"
    fio = "fio"
    naive = "naive"
    none = "none"


class Tails(str, Enum):
    host = "host"
    device = "device"


class IOMode(str, Enum):
    auto = "auto"
    gds = "gds"
    compat = "compat"
    posix = "posix"


def _default_config() -> Path:
    """configs/default.toml from the source tree, or the copy shipped in the package."""
    if DEFAULT_CONFIG.is_file():
        return DEFAULT_CONFIG
    from importlib.resources import files

    return Path(str(files("tiercache").joinpath("configs/default.toml")))


@app.callback()
def _root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log tiercache's decisions.")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s", stream=sys.stderr)


app.command()(inspect)
app.command()(purge)
app.command()(verify)
app.command()(calibrate)
app.command()(top)


@app.command()
def bench(
    jobfiles: Annotated[Optional[list[Path]], typer.Argument(help="fio-style job files (INI or TOML) to run.")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML config (default: configs/default.toml).")] = None,
    output_format: Annotated[OutputFormat, typer.Option("--output-format", help="normal or json.")] = OutputFormat.normal,
    batch: Annotated[int, typer.Option(help="Blocks per request.", min=1, max=4096)] = 32,
    blocks: Annotated[Optional[int], typer.Option(help="Blocks to move (default: fill the top tier).", min=1)] = None,
    root: Annotated[Optional[Path], typer.Option(help="File-tier root (overrides the config).")] = None,
    io: Annotated[Optional[IOMode], typer.Option("--io", help="I/O path (overrides the config's io_mode).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Random seed (default: fresh, reported).")] = None,
    keep: Annotated[bool, typer.Option(help="Keep the job's block files.")] = False,
    job: Annotated[Job, typer.Option(help="main: every tier and back, verified; copy: host<->device copy "
                                          "benchmark against cudaMemcpyAsync baselines (GPU); file: block files "
                                          "against dd / raw O_DIRECT / kvikio on the root's disk; layerwise: layer-wise "
                                          "onboarding into engine tensors against onboarding all first (GPU); metrics: "
                                          "cache calls with metrics off and on (exported, scraped), host<->file and "
                                          "(GPU) device<->host; shared: --procs processes writing and reading one shared root "
                                          "against one process (--bs, default 64k; --batch; --blocks per process); hf: transformers "
                                          "generate with its plain cache, its offloaded cache and tiercache's (GPU); "
                                          "vllm-tier: tiercache's vLLM storage tier against vLLM's own fs tier through "
                                          "vLLM's interface, and fio's best, on the root's disk (--bs: one row size, "
                                          "default 256k and 2m; --size per phase, default 1g; --batch chunks per job; "
                                          "--iodepth jobs in flight, default 8; --no-baseline: no fio); vllm-serve: a real "
                                          "vLLM engine on the GPU (random weights, a model's real geometry: --model) on "
                                          "shared-prefix requests: recompute, vLLM's CPU tier, its fs tier, TierCacheTier "
                                          "(exclusive, shared by two engines), restarts, --kill9; TTFT, tokens by source, "
                                          "tokens compared, files verified, fio's best read as the bound; scale: a root of --blocks block files "
                                          "(default 100000; --bs, default 4k): open from the saved index against a full "
                                          "scan (time, memory per block), lookup and get latency, inspect, verify against "
                                          "fio's best random read, purge (--no-baseline: no scan, no fio).")] = Job.main,
    procs: Annotated[int, typer.Option(help="Processes of the shared job.", min=2, max=64)] = 4,
    model: Annotated[Optional[list[str]], typer.Option("--model", help="vllm-serve: model geometries (configs/models "
                                                       "names, or config.json paths; repeat; default llama-3.1-8b and "
                                                       "qwen2.5-32b; --quick: tiny-llama).", rich_help_panel="vllm-serve job")] = None,
    prefixes: Annotated[int, typer.Option(help="vllm-serve: shared prefixes.", min=2, max=64, rich_help_panel="vllm-serve job")] = 4,
    prefix_tokens: Annotated[int, typer.Option(help="vllm-serve: tokens per prefix.", min=16, max=131072, rich_help_panel="vllm-serve job")] = 8192,
    suffix_tokens: Annotated[int, typer.Option(help="vllm-serve: tokens of each request after its prefix.", min=1, max=8192, rich_help_panel="vllm-serve job")] = 256,
    rounds: Annotated[int, typer.Option(help="vllm-serve: times each prefix is asked (round 0 cold, the rest repeats).", min=1, max=16, rich_help_panel="vllm-serve job")] = 3,
    max_tokens: Annotated[int, typer.Option(help="vllm-serve: tokens generated per request (greedy).", min=1, max=1024, rich_help_panel="vllm-serve job")] = 8,
    serve_mode: Annotated[Optional[list[str]], typer.Option("--serve-mode", help="vllm-serve: modes to run (repeat; default all: "
                                                            "recompute, cpu, fs, tiercache, tiercache-shared).", rich_help_panel="vllm-serve job")] = None,
    restart: Annotated[bool, typer.Option(help="vllm-serve: fresh engines on the fs and tiercache roots, repeats only.", rich_help_panel="vllm-serve job")] = True,
    kill9: Annotated[bool, typer.Option(help="vllm-serve: SIGKILL an engine while it stores, rerun on its root.", rich_help_panel="vllm-serve job")] = False,
    gpu_util: Annotated[float, typer.Option(help="vllm-serve: gpu_memory_utilization of one engine (the shared pair: half each).", min=0.05, max=0.98, rich_help_panel="vllm-serve job")] = 0.9,
    cpu_prefixes: Annotated[float, typer.Option(help="vllm-serve: vLLM's CPU tier, in prefixes' worth of KV (below --prefixes).", min=0.1, max=64, rich_help_panel="vllm-serve job")] = 2.0,
    tensor_parallel: Annotated[int, typer.Option(help="vllm-serve: GPUs per engine (vLLM's tensor_parallel_size).", min=1, max=8, rich_help_panel="vllm-serve job")] = 1,
    shared_gpus: Annotated[Optional[str], typer.Option(help="vllm-serve: 'A,B': the shared pair's engines on GPUs A and B (default: halves of one GPU).", rich_help_panel="vllm-serve job")] = None,
    context: Annotated[Optional[list[int]], typer.Option(help="hf job: context lengths in tokens (repeat the option; "
                                                              "default 16384 and 32768).", min=64)] = None,
    new_tokens: Annotated[int, typer.Option(help="hf job: tokens generated per run.", min=2, max=4096)] = 32,
    tokens_per_block: Annotated[int, typer.Option(help="hf job: TieredCache tokens_per_block.", min=1, max=65536)] = 1024,
    ring_layers: Annotated[Optional[list[int]], typer.Option(help="hf job: TieredCache ring_layers (layer buffers in "
                                                             "VRAM; repeat to run tiercache's modes once per value; "
                                                             "default 2).", min=2, max=64)] = None,
    tails: Annotated[Optional[list[Tails]], typer.Option(help="hf job: TieredCache tails (where each layer's partial "
                                                       "last block lives: host = pinned host memory, device = "
                                                       "VRAM; repeat to run tiercache's modes once per value; "
                                                       "default host).")] = None,
    hf_mode: Annotated[Optional[list[str]], typer.Option("--hf-mode", help="hf job: modes to run (repeat; default all: "
                                                         "plain, plain-h2d, offloaded, tiercache-host, tiercache-files).")] = None,
    quick: Annotated[bool, typer.Option(help="Smaller sizes (copy, layerwise and metrics jobs).")] = False,
    repeat: Annotated[int, typer.Option(help="Alternated passes of the file, metrics (default 5), hf (default 3) and fio-style jobs (medians of the ratios to the baseline of each pass; hf: of each mode's tokens/s).", min=1, max=20)] = 1,
    rw: Annotated[Optional[str], typer.Option("--rw", help="fio job: read|write|randread|randwrite|rw|randrw "
                                                           "(read = onboard, write = offload).", rich_help_panel="fio job")] = None,
    bs: Annotated[Optional[str], typer.Option("--bs", help="Block size (16k, 2m; default: the config's pool).", rich_help_panel="fio job")] = None,
    size: Annotated[Optional[str], typer.Option("--size", help="Bytes per job (e.g. 256m).", rich_help_panel="fio job")] = None,
    nblocks: Annotated[Optional[int], typer.Option("--nblocks", help="Blocks per job (instead of --size).", rich_help_panel="fio job")] = None,
    iodepth: Annotated[Optional[int], typer.Option("--iodepth", help="Blocks in flight per job.", rich_help_panel="fio job")] = None,
    iodepth_batch: Annotated[Optional[int], typer.Option("--iodepth_batch", "--iodepth-batch", help="Blocks per engine request (default: iodepth/4, at least 1).", rich_help_panel="fio job")] = None,
    numjobs: Annotated[Optional[int], typer.Option("--numjobs", help="Jobs (threads) running at once.", rich_help_panel="fio job")] = None,
    runtime: Annotated[Optional[float], typer.Option("--runtime", help="Seconds to run.", rich_help_panel="fio job")] = None,
    time_based: Annotated[bool, typer.Option("--time_based", "--time-based", help="Loop over the blocks until --runtime.", rich_help_panel="fio job")] = False,
    direct: Annotated[Optional[int], typer.Option("--direct", help="1: O_DIRECT block files.", min=0, max=1, rich_help_panel="fio job")] = None,
    tiers: Annotated[Optional[str], typer.Option("--tiers", help="device:host | host:file | device:file.", rich_help_panel="fio job")] = None,
    verify: Annotated[Optional[int], typer.Option("--verify", help="1: check every block's bytes after the run.", min=0, max=1, rich_help_panel="fio job")] = None,
    baseline: Annotated[Optional[Baseline], typer.Option("--baseline", help="What the job is measured against, in the same run: fio on the same directory with the same job (file tiers), the naive way, or nothing; auto: fio where installed, else naive.", rich_help_panel="fio job")] = None,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Same as --baseline none.", rich_help_panel="fio job")] = False,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of bandwidth vs baseline and latency percentiles (needs matplotlib).", rich_help_panel="fio job")] = None,
) -> None:
    """Benchmarks. With no fio options: the main job (fill the top tier with random blocks,
    offload them through every tier to files, reopen, onboard them back, verify every byte;
    exit 0 only if every byte verified), or --job copy / --job file.

    With fio options (--rw, --bs, --iodepth, ...) or job files: fio-style jobs on a tier pair,
    printed like fio (IOPS, bandwidth, completion-latency percentiles) or as fio-style JSON,
    each with its naive baseline on the same bytes and the ratio.
    """
    fio_opts = {"rw": rw, "bs": bs, "size": size, "nblocks": nblocks, "iodepth": iodepth, "iodepth_batch": iodepth_batch,
                "numjobs": numjobs, "runtime": runtime, "direct": direct, "tiers": tiers, "verify": verify,
                "baseline": "none" if no_baseline else (baseline.value if baseline else None),
                "io": io.value if io else None, "time_based": time_based or None}
    fio_opts = {k: v for k, v in fio_opts.items() if v is not None}
    if job is Job.hf:
        _hf_job(output_format, root, context, new_tokens, tokens_per_block, quick, ring_layers, hf_mode,
                repeat if repeat > 1 else 3, tails)
        return
    if job is Job.shared:
        _shared_job(config, output_format, root, procs, blocks, bs, min(batch, 256), repeat, seed, quick)
        return
    if job is Job.scale:
        _scale_job(config, output_format, root, blocks, bs, seed, keep, no_baseline or (baseline is not None and baseline.value == "none"))
        return
    if job is Job.vllm_serve:
        _vllm_serve_job(config, output_format, root, model, serve_mode, prefixes, prefix_tokens, suffix_tokens, rounds,
                        max_tokens, restart, kill9, gpu_util, seed, keep,
                        not no_baseline and (baseline is None or baseline.value != "none"), quick, cpu_prefixes,
                        tensor_parallel, shared_gpus)
        return
    if job is Job.vllm_tier:
        _vllm_tier_job(config, output_format, root, bs, size, batch, iodepth or 8, repeat if repeat > 1 else 3, seed,
                       not no_baseline and (baseline is None or baseline.value != "none"), quick)
        return
    if jobfiles or (set(fio_opts) - {"io"}) or plot_path is not None:
        from .fio_cmd import run_fio

        run_fio(jobfiles or [], fio_opts, config, root, output_format is OutputFormat.json, plot_path, repeat)
        return
    if job is Job.copy:
        _copy_job(config, output_format, quick)
        return
    if job is Job.file:
        _file_job(config, output_format, root, blocks, io, repeat)
        return
    if job is Job.layerwise:
        _layerwise_job(output_format, root, blocks, quick)
        return
    if job is Job.metrics:
        _metrics_job(config, output_format, root, blocks, batch, repeat, seed, quick)
        return
    try:
        cfg = load_config(config or _default_config(), root=root, io_mode=io.value if io else None)
        progress = None if output_format is OutputFormat.json else (lambda s: typer.echo(f"  ... {s}", err=True))
        rep = run_main_job(cfg, batch=batch, blocks=blocks, seed=seed, keep=keep, progress=progress)
    except TierCacheError as exc:
        _fail(str(exc))
    if output_format is OutputFormat.json:
        typer.echo(json.dumps(rep, indent=2))
    else:
        typer.echo(format_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _copy_job(config: Path | None, output_format: OutputFormat, quick: bool) -> None:
    from tiercache.bench.benchcopy import format_copy_report, run_copy_bench

    try:
        cfg = load_config(config or _default_config())
        log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
        rep = run_copy_bench(quick=quick, device_id=cfg.device_id, copy_kernel_sms=cfg.copy_kernel_sms,
                             carveout=cfg.carveout_sms or 4, log=log)
    except TierCacheError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else format_copy_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _file_job(config: Path | None, output_format: OutputFormat, root: Path | None, blocks: int | None,
              io: IOMode | None, repeat: int = 1) -> None:
    from tiercache.bench.benchfile import format_file_report, run_file_bench_repeated

    try:
        cfg = load_config(config or _default_config(), root=root)
        log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
        rep = run_file_bench_repeated(cfg.root, cfg.pools[0], repeat, blocks=blocks or 256, io_threads=cfg.io_threads,
                                      io_mode=io.value if io else cfg.io_mode, log=log)
    except TierCacheError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else format_file_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _layerwise_job(output_format: OutputFormat, root: Path | None, blocks: int | None, quick: bool) -> None:
    from tiercache.bench.benchlayer import format_layerwise_report, run_layerwise_bench
    from tiercache.cuda import cuda_status

    if not cuda_status().available:
        _fail(f"--job layerwise needs a CUDA GPU: {cuda_status().reason}")
    log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
    kw = dict(num_layers=8, num_blocks=128, matmul_n=1024, repeats=2) if quick else {}
    rep = run_layerwise_bench(blocks=blocks or (64 if quick else 256), root=root, log=log, **kw)
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else format_layerwise_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _metrics_job(config: Path | None, output_format: OutputFormat, root: Path | None, blocks: int | None,
                 batch: int, repeat: int, seed: int | None, quick: bool) -> None:
    from tiercache.bench.benchmetrics import format_metrics_report, run_metrics_bench

    try:
        base = root or load_config(config or _default_config()).root
        log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
        rep = run_metrics_bench(Path(base), blocks=blocks or (256 if quick else 1024), batch=min(batch, 64),
                                repeat=repeat if repeat > 1 else (3 if quick else 5), seed=seed, log=log)
    except TierCacheError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else format_metrics_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _shared_job(config: Path | None, output_format: OutputFormat, root: Path | None, procs: int,
                blocks: int | None, bs: str | None, batch: int, repeat: int, seed: int | None, quick: bool) -> None:
    from tiercache.bench.benchshared import format_shared_report, run_shared_bench
    from tiercache.bench.fiospec import parse_size

    try:
        cfg = load_config(config or _default_config(), root=root)
        log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
        opts = {"fsync": cfg.fsync, "io_engine": cfg.io_engine, "io_threads": cfg.io_threads,
                "direct_io": cfg.direct_io, "io_mode": cfg.io_mode}
        rep = run_shared_bench(Path(cfg.root), procs=procs, blocks=blocks or (128 if quick else 512),
                               block_bytes=parse_size(bs, "--bs") if bs else 64 << 10, batch=batch,
                               repeat=repeat if repeat > 1 else 3, seed=seed, file_options=opts, log=log)
    except TierCacheError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else format_shared_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _vllm_tier_job(config: Path | None, output_format: OutputFormat, root: Path | None, bs: str | None,
                   size: str | None, batch: int, in_flight: int, repeat: int, seed: int | None, fio: bool,
                   quick: bool) -> None:
    from tiercache.bench.benchvllm import format_vllm_tier_report, run_vllm_tier_bench
    from tiercache.bench.fiospec import parse_size

    try:
        base = root or load_config(config or _default_config()).root
        log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
        rows = (parse_size(bs, "--bs"),) if bs else (256 << 10, 2 << 20)
        total = parse_size(size, "--size") if size else (256 << 20 if quick else 1 << 30)
        rep = run_vllm_tier_bench(Path(base), row_sizes=rows, total_bytes=total, per_job=batch, in_flight=in_flight,
                                  repeat=1 if quick else repeat, fio=fio, seed=seed, log=log)
    except TierCacheError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else format_vllm_tier_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _vllm_serve_job(config: Path | None, output_format: OutputFormat, root: Path | None, models: list[str] | None,
                    modes: list[str] | None, prefixes: int, prefix_tokens: int, suffix_tokens: int, rounds: int,
                    max_tokens: int, restart: bool, kill9: bool, gpu_util: float, seed: int | None, keep: bool,
                    fio: bool, quick: bool, cpu_prefixes: float = 2.0, tensor_parallel: int = 1,
                    shared_gpus: str | None = None) -> None:
    from tiercache.bench.benchserve import MODES, format_serve_report, run_serve_bench

    if quick:
        prefix_tokens, prefixes, rounds = min(prefix_tokens, 2048), min(prefixes, 3), min(rounds, 2)
    reports = []
    pair = None
    if shared_gpus is not None:
        try:
            pair = tuple(int(g) for g in shared_gpus.split(","))
        except ValueError:
            _fail(f"--shared-gpus {shared_gpus!r}: give two GPU indices, e.g. 0,1")
    try:
        base = root or load_config(config or _default_config()).root
        log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
        for name in models or (["tiny-llama"] if quick else ["llama-3.1-8b", "qwen2.5-32b"]):
            rep = run_serve_bench(Path(base), model=name, modes=tuple(modes or MODES), prefixes=prefixes,
                                  prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens, rounds=rounds,
                                  max_tokens=max_tokens, restart=restart, kill9=kill9, fio=fio, seed=seed,
                                  gpu_util=gpu_util, keep=keep, cpu_tier_prefixes=cpu_prefixes,
                                  tensor_parallel=tensor_parallel, shared_gpus=pair, log=log)
            reports.append(rep)
            if output_format is not OutputFormat.json:
                typer.echo(format_serve_report(rep))
    except TierCacheError as exc:
        _fail(str(exc))
    if output_format is OutputFormat.json:
        typer.echo(json.dumps({"job": "vllm-serve", "runs": reports, "ok": all(r["ok"] for r in reports)}, indent=2))
    raise typer.Exit(0 if all(r["ok"] for r in reports) else 1)


def _scale_job(config: Path | None, output_format: OutputFormat, root: Path | None, blocks: int | None,
               bs: str | None, seed: int | None, keep: bool, no_baseline: bool) -> None:
    from tiercache.bench.benchscale import format_scale_report, run_scale_bench
    from tiercache.bench.fiospec import parse_size

    try:
        base = root or load_config(config or _default_config()).root
        log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
        rep = run_scale_bench(Path(base), blocks=blocks or 100_000, block_bytes=parse_size(bs, "--bs") if bs else 4096,
                              scan=not no_baseline, fio=not no_baseline, seed=seed, keep=keep, log=log)
    except TierCacheError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else format_scale_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _hf_job(output_format: OutputFormat, root: Path | None, contexts: list[int] | None, new_tokens: int,
            tokens_per_block: int, quick: bool, ring_layers: list[int] | None = None,
            modes: list[str] | None = None, repeat: int = 3, tails: list[Tails] | None = None) -> None:
    from tiercache.bench.benchhf import MODES, format_hf_report, run_hf_bench

    bad = sorted(set(modes or ()) - set(MODES))
    if bad:
        _fail(f"--hf-mode {bad[0]!r}: expected one of {', '.join(MODES)}")

    try:
        base = root or load_config(_default_config()).root
        log = (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))
        ctx = tuple(contexts or ((4096, 8192) if quick else (16384, 32768)))
        rep = run_hf_bench(contexts=ctx, new_tokens=new_tokens, root=Path(base), tokens_per_block=tokens_per_block,
                           ring_layers=tuple(ring_layers or (2,)), tails=tuple(t.value for t in tails or (Tails.host,)),
                           modes=tuple(modes or MODES), repeat=repeat,
                           log=log)
    except TierCacheError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else format_hf_report(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
