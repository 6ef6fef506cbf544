"""``tiercache bench``: the main job and the benchmark jobs, one subcommand each with only its
own options (``tiercache bench JOB --help``); ``tiercache bench`` alone runs the main job."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from tiercache.config import load_config
from tiercache.errors import TierCacheError
from tiercache.resources import default_config
from tiercache.settings import IO_MODES

from .common import fail as _fail


class OutputFormat(str, Enum):
    normal = "normal"
    json = "json"


class Baseline(str, Enum):
    auto = "auto"
    fio = "fio"
    naive = "naive"
    none = "none"


class Tails(str, Enum):
    host = "host"
    device = "device"


#: the [file] io_mode choices (tiercache.settings) as the options' enum
IOMode = Enum("IOMode", {m: m for m in IO_MODES}, type=str)


# -- options several jobs share ---------------------------------------------------------------
ConfigOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="TOML config (default: configs/default.toml).")
]
FormatOpt = Annotated[OutputFormat, typer.Option("--output-format", help="normal or json.")]
RootOpt = Annotated[Optional[Path], typer.Option(help="Directory the job works in (overrides the config's root).")]
SeedOpt = Annotated[Optional[int], typer.Option(help="Random seed (default: fresh, reported).")]
KeepOpt = Annotated[bool, typer.Option(help="Keep the job's files.")]
QuickOpt = Annotated[bool, typer.Option(help="Smaller sizes.")]
NoBaselineOpt = Annotated[bool, typer.Option("--no-baseline", help="Skip the baseline (fio, the full scan).")]


def _settings(flag: str, items) -> dict:
    """``KEY=VALUE`` strings as settings (each value JSON where it parses, else the text)."""
    out = {}
    for kv in items:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            _fail(f"{flag} {kv!r}: give KEY=VALUE, e.g. io_engine=threads")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _strings_opt(flag: str, text: str):
    """A repeatable string option ``flag`` (None when not given)."""
    return Annotated[Optional[list[str]], typer.Option(flag, help=text)]


def _repeat_opt(default: int, what: str):
    return Annotated[int, typer.Option(help=f"Alternated passes ({what}; default {default}).", min=1, max=20)]


def _log(output_format: OutputFormat) -> Callable[[str], None]:
    return (lambda s: None) if output_format is OutputFormat.json else (lambda s: typer.echo(s, err=True))


def _report(rep: dict, output_format: OutputFormat, fmt: Callable[[dict], str]) -> None:
    typer.echo(json.dumps(rep, indent=2) if output_format is OutputFormat.json else fmt(rep))
    raise typer.Exit(0 if rep["ok"] else 1)


def _base(config: Path | None, root: Path | None) -> Path:
    return Path(root or load_config(config or default_config()).root)


bench_app = typer.Typer(help="Benchmarks and the main job. Alone: the main job (every tier and back, every byte "
                             "verified). Each job: tiercache bench JOB --help.", no_args_is_help=False)

# -- the main job ------------------------------------------------------------------------------
BatchOpt = Annotated[int, typer.Option(help="Blocks per request.", min=1, max=4096)]
BlocksOpt = Annotated[Optional[int], typer.Option(help="Blocks to move (default: fill the top tier).", min=1)]
IOOpt = Annotated[Optional[IOMode], typer.Option("--io", help="I/O path (overrides the config's io_mode).")]


def _main_job(config, output_format, batch, blocks, root, io, seed, keep) -> None:
    from tiercache.bench.mainjob import format_report, run_main_job

    try:
        cfg = load_config(config or default_config(), root=root, io_mode=io.value if io else None)
        progress = None if output_format is OutputFormat.json else (lambda s: typer.echo(f"  ... {s}", err=True))
        rep = run_main_job(cfg, batch=batch, blocks=blocks, seed=seed, keep=keep, progress=progress)
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_report)


@bench_app.callback(invoke_without_command=True)
def bench(ctx: typer.Context, config: ConfigOpt = None, output_format: FormatOpt = OutputFormat.normal,
          batch: BatchOpt = 32, blocks: BlocksOpt = None, root: RootOpt = None, io: IOOpt = None,
          seed: SeedOpt = None, keep: KeepOpt = False) -> None:
    """The main job when no job is named: fill the top tier with random blocks, offload them
    through every tier to files, reopen, onboard them back, verify every byte (exit 0 only if
    every byte verified). With a job: that job (its options after its name)."""
    if ctx.invoked_subcommand is None:
        _main_job(config, output_format, batch, blocks, root, io, seed, keep)


@bench_app.command("main")
def main_cmd(config: ConfigOpt = None, output_format: FormatOpt = OutputFormat.normal, batch: BatchOpt = 32,
             blocks: BlocksOpt = None, root: RootOpt = None, io: IOOpt = None, seed: SeedOpt = None,
             keep: KeepOpt = False) -> None:
    """Every tier and back, every byte verified (what tiercache bench alone runs)."""
    _main_job(config, output_format, batch, blocks, root, io, seed, keep)


# -- fio-style jobs ----------------------------------------------------------------------------
@bench_app.command("fio")
def fio_cmd(
    jobfiles: Annotated[Optional[list[Path]], typer.Argument(help="fio-style job files (INI or TOML) to run.")] = None,
    config: ConfigOpt = None,
    output_format: FormatOpt = OutputFormat.normal,
    root: RootOpt = None,
    io: IOOpt = None,
    repeat: _repeat_opt(1, "medians of the ratios to each pass's baseline") = 1,
    rw: Annotated[
        Optional[str],
        typer.Option("--rw", help="read|write|randread|randwrite|rw|randrw (read = onboard, write = offload)."),
    ] = None,
    bs: Annotated[Optional[str], typer.Option("--bs", help="Block size (16k, 2m; default: the config's pool).")] = None,
    size: Annotated[Optional[str], typer.Option("--size", help="Bytes per job (e.g. 256m).")] = None,
    nblocks: Annotated[Optional[int], typer.Option("--nblocks", help="Blocks per job (instead of --size).")] = None,
    iodepth: Annotated[Optional[int], typer.Option("--iodepth", help="Blocks in flight per job.")] = None,
    iodepth_batch: Annotated[
        Optional[int],
        typer.Option(
            "--iodepth_batch", "--iodepth-batch", help="Blocks per engine request (default: iodepth/4, at least 1)."
        ),
    ] = None,
    numjobs: Annotated[Optional[int], typer.Option("--numjobs", help="Jobs (threads) running at once.")] = None,
    runtime: Annotated[Optional[float], typer.Option("--runtime", help="Seconds to run.")] = None,
    time_based: Annotated[
        bool, typer.Option("--time_based", "--time-based", help="Loop over the blocks until --runtime.")
    ] = False,
    direct: Annotated[Optional[int], typer.Option("--direct", help="1: O_DIRECT block files.", min=0, max=1)] = None,
    tiers: Annotated[Optional[str], typer.Option("--tiers", help="device:host | host:file | device:file.")] = None,
    verify: Annotated[
        Optional[int], typer.Option("--verify", help="1: check every block's bytes after the run.", min=0, max=1)
    ] = None,
    baseline: Annotated[
        Optional[Baseline],
        typer.Option(
            "--baseline",
            help="What the job is measured against, in the "
            "same run: fio on the same directory with the same job (file "
            "tiers), the naive way, or nothing; auto: fio where installed, "
            "else naive.",
        ),
    ] = None,
    no_baseline: NoBaselineOpt = False,
    plot_path: Annotated[
        Optional[Path],
        typer.Option("--plot", help="Write a PNG of bandwidth vs baseline and latency percentiles (needs matplotlib)."),
    ] = None,
) -> None:
    """fio-style jobs on a tier pair (options or job files), printed like fio (IOPS, bandwidth,
    completion-latency percentiles) or as fio-style JSON, each with its baseline on the same
    bytes and the ratio."""
    opts = {"rw": rw, "bs": bs, "size": size, "nblocks": nblocks, "iodepth": iodepth, "iodepth_batch": iodepth_batch,
            "numjobs": numjobs, "runtime": runtime, "direct": direct, "tiers": tiers, "verify": verify,
            "baseline": "none" if no_baseline else (baseline.value if baseline else None),
            "io": io.value if io else None, "time_based": time_based or None}
    opts = {k: v for k, v in opts.items() if v is not None}
    if not jobfiles and not (set(opts) - {"io"}):
        _fail("tiercache bench fio: give job files or at least one job option (--rw, --bs, ...)")
    _run_fio(jobfiles or [], opts, config, root, output_format is OutputFormat.json, plot_path, repeat)


def _run_fio(jobfiles: list[Path], overrides: dict, config: Path | None, root: Path | None, as_json: bool,
             plot_path: Path | None, repeat: int = 1) -> None:
    """Run the jobs of ``jobfiles`` (or one job from the command-line options) and print them;
    ``repeat`` alternated passes of each (tiercache, then its baseline), merged at the median
    ratio."""
    from tiercache import __version__
    from tiercache.bench.fiorun import format_fio, merge_passes, plot, run_job
    from tiercache.bench.fiospec import job_from_options, load_job_file

    from .common import DEFAULT_CONFIG, EXIT_FINDING

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
        _fail(str(exc))
    except RuntimeError as exc:  # a transfer or verification failure: a finding
        _fail(str(exc), EXIT_FINDING)
    if as_json:
        typer.echo(json.dumps({"fio version": f"tiercache-{__version__}", "jobs": records}, indent=2))
    else:
        typer.echo(format_fio(records))


@bench_app.command("fio-table")
def fio_table_cmd(
    files: Annotated[list[Path], typer.Argument(help="JSON of `tiercache bench fio --output-format json` runs.")],
) -> None:
    """The file-vs-fio table of saved fio-style runs: per job tiercache's GB/s, fio's on the same
    directory and the ratio (with its range), durable fio and that ratio, and p99 latencies."""
    from tiercache.bench.fiorun import format_fio_table

    records = []
    for f in files:
        try:
            records += json.loads(f.read_text())["jobs"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _fail(f"tiercache bench fio-table: {f}: not the JSON of a fio-style run ({type(exc).__name__}: {exc})")
    typer.echo(format_fio_table(records))


# -- the other jobs ----------------------------------------------------------------------------
@bench_app.command("copy")
def copy_cmd(config: ConfigOpt = None, output_format: FormatOpt = OutputFormat.normal, quick: QuickOpt = False) -> None:
    """Scattered host <-> device block copies (16 KiB-2 MiB) against one contiguous
    cudaMemcpyAsync, the per-block loop and cuMemcpyBatchAsync; partial copies; copies beside a
    bf16 matrix product (GPU)."""
    from tiercache.bench.benchcopy import format_copy_report, run_copy_bench

    try:
        cfg = load_config(config or default_config())
        rep = run_copy_bench(quick=quick, device_id=cfg.device_id, copy_kernel_sms=cfg.copy_kernel_sms,
                             carveout=cfg.carveout_sms or 4, log=_log(output_format))
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_copy_report)


@bench_app.command("file")
def file_cmd(config: ConfigOpt = None, output_format: FormatOpt = OutputFormat.normal, root: RootOpt = None,
             blocks: Annotated[Optional[int], typer.Option(help="Block files per pass (default 256).", min=1)] = None,
             io: IOOpt = None, repeat: _repeat_opt(1, "medians over passes") = 1) -> None:
    """Per-block files against fio (where installed), dd / raw O_DIRECT I/O and one big kvikio
    read on the root's disk: durable writes, cold and warm reads, checksum cost."""
    from tiercache.bench.benchfile import format_file_report, run_file_bench_repeated

    try:
        cfg = load_config(config or default_config(), root=root)
        rep = run_file_bench_repeated(cfg.root, cfg.pools[0], repeat, blocks=blocks or 256, io_threads=cfg.io_threads,
                                      io_mode=io.value if io else cfg.io_mode, log=_log(output_format))
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_file_report)


@bench_app.command("layerwise")
def layerwise_cmd(
    output_format: FormatOpt = OutputFormat.normal,
    root: RootOpt = None,
    blocks: Annotated[Optional[int], typer.Option(help="Blocks (default 256; --quick 64).", min=1)] = None,
    quick: QuickOpt = False,
) -> None:
    """Layer-wise onboarding into engine tensors against onboarding everything first, beside
    per-layer compute (GPU)."""
    from tiercache.bench.benchlayerwise import format_layerwise_report, run_layerwise_bench
    from tiercache.cuda import cuda_status

    if not cuda_status().available:
        _fail(f"tiercache bench layerwise needs a CUDA GPU: {cuda_status().reason}")
    kw = dict(num_layers=8, num_blocks=128, matmul_n=1024, repeats=2) if quick else {}
    rep = run_layerwise_bench(blocks=blocks or (64 if quick else 256), root=root, log=_log(output_format), **kw)
    _report(rep, output_format, format_layerwise_report)


@bench_app.command("metrics")
def metrics_cmd(
    config: ConfigOpt = None,
    output_format: FormatOpt = OutputFormat.normal,
    root: RootOpt = None,
    blocks: Annotated[Optional[int], typer.Option(help="Blocks (default 1024; --quick 256).", min=1)] = None,
    batch: Annotated[int, typer.Option(help="Blocks per call (at most 64).", min=1, max=4096)] = 32,
    repeat: _repeat_opt(5, "--quick: 3") = 5,
    seed: SeedOpt = None,
    quick: QuickOpt = False,
) -> None:
    """The same cache calls with metrics off and on, two caches side by side, calls
    interleaved; plus what one scrape costs."""
    from tiercache.bench.benchmetrics import format_metrics_report, run_metrics_bench

    try:
        rep = run_metrics_bench(_base(config, root), blocks=blocks or (256 if quick else 1024), batch=min(batch, 64),
                                repeat=3 if quick and repeat == 5 else repeat, seed=seed, log=_log(output_format))
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_metrics_report)


@bench_app.command("shared")
def shared_cmd(
    config: ConfigOpt = None,
    output_format: FormatOpt = OutputFormat.normal,
    root: RootOpt = None,
    procs: Annotated[int, typer.Option(help="Processes on the shared root.", min=2, max=64)] = 4,
    blocks: Annotated[Optional[int], typer.Option(help="Blocks per process (default 512; --quick 128).", min=1)] = None,
    bs: Annotated[Optional[str], typer.Option("--bs", help="Block size (default 64k).")] = None,
    batch: Annotated[int, typer.Option(help="Blocks per call.", min=1, max=256)] = 32,
    repeat: _repeat_opt(3, "medians") = 3,
    seed: SeedOpt = None,
    quick: QuickOpt = False,
) -> None:
    """--procs processes writing and reading one shared root against one process."""
    from tiercache.bench.benchshared import format_shared_report, run_shared_bench
    from tiercache.bench.fiospec import parse_size

    try:
        cfg = load_config(config or default_config(), root=root)
        opts = {"fsync": cfg.fsync, "io_engine": cfg.io_engine, "io_threads": cfg.io_threads,
                "direct_io": cfg.direct_io, "io_mode": cfg.io_mode}
        rep = run_shared_bench(Path(cfg.root), procs=procs, blocks=blocks or (128 if quick else 512),
                               block_bytes=parse_size(bs, "--bs") if bs else 64 << 10, batch=batch, repeat=repeat,
                               seed=seed, file_options=opts, log=_log(output_format))
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_shared_report)


@bench_app.command("vllm-tier")
def vllm_tier_cmd(
    config: ConfigOpt = None,
    output_format: FormatOpt = OutputFormat.normal,
    root: RootOpt = None,
    bs: Annotated[Optional[str], typer.Option("--bs", help="One row size (default: 256k and 2m).")] = None,
    size: Annotated[Optional[str], typer.Option("--size", help="Bytes per phase (default 1g; --quick 256m).")] = None,
    batch: Annotated[int, typer.Option(help="Chunks per job.", min=1, max=4096)] = 32,
    iodepth: Annotated[int, typer.Option("--iodepth", help="Jobs in flight.", min=1, max=1024)] = 8,
    repeat: _repeat_opt(3, "medians; --quick: 1") = 3,
    seed: SeedOpt = None,
    no_baseline: NoBaselineOpt = False,
    quick: QuickOpt = False,
) -> None:
    """TierCacheTier against vLLM's own fs tier through vLLM's interface, on the same directory
    and CPU buffer, and fio's best on the root's disk."""
    from tiercache.bench.benchvllmtier import format_vllm_tier_report, run_vllm_tier_bench
    from tiercache.bench.fiospec import parse_size

    try:
        rows = (parse_size(bs, "--bs"),) if bs else (256 << 10, 2 << 20)
        total = parse_size(size, "--size") if size else (256 << 20 if quick else 1 << 30)
        rep = run_vllm_tier_bench(
            _base(config, root),
            row_sizes=rows,
            total_bytes=total,
            per_job=batch,
            in_flight=iodepth,
            repeat=1 if quick else repeat,
            fio=not no_baseline,
            seed=seed,
            log=_log(output_format),
        )
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_vllm_tier_report)


@bench_app.command("vllm-serve")
def vllm_serve_cmd(
    config: ConfigOpt = None,
    output_format: FormatOpt = OutputFormat.normal,
    root: RootOpt = None,
    model: _strings_opt(
        "--model",
        "Model geometries (configs/models names, or config.json paths; repeat; default llama-3.1-8b and "
        "qwen2.5-32b; --quick: tiny-llama).",
    ) = None,
    prefixes: Annotated[int, typer.Option(help="Shared prefixes.", min=2, max=64)] = 4,
    prefix_tokens: Annotated[int, typer.Option(help="Tokens per prefix.", min=16, max=131072)] = 8192,
    suffix_tokens: Annotated[int, typer.Option(help="Tokens of each request after its prefix.", min=1, max=8192)] = 256,
    rounds: Annotated[
        int, typer.Option(help="Times each prefix is asked (round 0 cold, the rest repeats).", min=1, max=16)
    ] = 3,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per request (greedy).", min=1, max=1024)] = 8,
    serve_mode: Annotated[
        Optional[list[str]],
        typer.Option(
            "--serve-mode",
            help="Modes to run (repeat; default all: "
            "recompute, cpu, fs, tiercache, connector, tiercache-shared, connector-shared).",
        ),
    ] = None,
    restart: Annotated[bool, typer.Option(help="Fresh engines on the fs and tiercache roots, repeats only.")] = True,
    kill9: Annotated[bool, typer.Option(help="SIGKILL an engine while it stores, rerun on its root.")] = False,
    gpu_util: Annotated[
        float,
        typer.Option(
            help="gpu_memory_utilization of one engine (the shared pair on one GPU: half each).", min=0.05, max=0.98
        ),
    ] = 0.9,
    cpu_prefixes: Annotated[
        float, typer.Option(help="vLLM's CPU tier, in prefixes' worth of KV (below --prefixes).", min=0.1, max=64)
    ] = 2.0,
    tensor_parallel: Annotated[
        int, typer.Option(help="GPUs per engine (vLLM's tensor_parallel_size).", min=1, max=8)
    ] = 1,
    shared_gpus: Annotated[
        Optional[str],
        typer.Option(help="'A,B': the shared pair's engines on GPUs A and B (default: halves of one GPU)."),
    ] = None,
    round_gap: Annotated[
        float,
        typer.Option(help="Seconds each engine stays idle before each repeat round (the round before's writes "
                     "finish first).", min=0, max=600),
    ] = 0.0,
    async_scheduling: Annotated[
        Optional[bool],
        typer.Option("--async-scheduling/--no-async-scheduling",
                     help="vLLM's async scheduling in every engine (default: vLLM's, on). Off, the connector "
                     "loads a prefix in the step that computes its suffix (load_mode 'auto')."),
    ] = None,
    connector_set: _strings_opt(
        "--connector-set",
        "KEY=VALUE of the connector mode's kv_connector_extra_config (repeat; e.g. io_engine=threads).",
    ) = None,
    connector_variant: _strings_opt(
        "--connector-variant",
        "KEY=VALUE[,KEY=VALUE...]: one more connector mode in the same run with these settings "
        "(repeat; modes connector~1, connector~2, ...: A/B on one machine in one run).",
    ) = None,
    seed: SeedOpt = None,
    keep: KeepOpt = False,
    no_baseline: NoBaselineOpt = False,
    quick: QuickOpt = False,
) -> None:
    """A real vLLM engine per mode on the GPU (random weights, a model's real geometry) on
    shared-prefix requests: recompute, vLLM's CPU tier, its fs tier, TierCacheTier (exclusive,
    shared by two engines), restarts, a SIGKILL while storing; TTFT, tokens by source, tokens
    compared, roots verified, fio's best read as the bound."""
    from tiercache.bench.benchvllmserve import MODES, format_serve_report, run_serve_bench

    if quick:
        prefix_tokens, prefixes, rounds = min(prefix_tokens, 2048), min(prefixes, 3), min(rounds, 2)
    pair = None
    if shared_gpus is not None:
        try:
            pair = tuple(int(g) for g in shared_gpus.split(","))
        except ValueError:
            _fail(f"--shared-gpus {shared_gpus!r}: give two GPU indices, e.g. 0,1")
    extra = _settings("--connector-set", connector_set or ())
    variants = [_settings("--connector-variant", v.split(",")) for v in connector_variant or ()]
    reports = []
    try:
        base = _base(config, root)
        for name in model or (["tiny-llama"] if quick else ["llama-3.1-8b", "qwen2.5-32b"]):
            rep = run_serve_bench(base, model=name, modes=tuple(serve_mode or MODES), prefixes=prefixes,
                                  prefix_tokens=prefix_tokens, suffix_tokens=suffix_tokens, rounds=rounds,
                                  max_tokens=max_tokens, restart=restart, kill9=kill9, fio=not no_baseline, seed=seed,
                                  gpu_util=gpu_util, keep=keep, cpu_tier_prefixes=cpu_prefixes,
                                  tensor_parallel=tensor_parallel, shared_gpus=pair, connector_settings=extra,
                                  round_gap_s=round_gap, connector_variants=variants,
                                  async_scheduling=async_scheduling, log=_log(output_format))
            reports.append(rep)
            if output_format is not OutputFormat.json:
                typer.echo(format_serve_report(rep))
    except TierCacheError as exc:
        _fail(str(exc))
    if output_format is OutputFormat.json:
        typer.echo(json.dumps({"job": "vllm-serve", "runs": reports, "ok": all(r["ok"] for r in reports)}, indent=2))
    raise typer.Exit(0 if all(r["ok"] for r in reports) else 1)


@bench_app.command("scale")
def scale_cmd(config: ConfigOpt = None, output_format: FormatOpt = OutputFormat.normal, root: RootOpt = None,
              blocks: Annotated[Optional[int], typer.Option(help="Block files (default 100000).", min=1)] = None,
              bs: Annotated[Optional[str], typer.Option("--bs", help="Block size (default 4k).")] = None,
              seed: SeedOpt = None, keep: KeepOpt = False, no_baseline: NoBaselineOpt = False) -> None:
    """A root of --blocks block files: open from the saved index against a full scan (time,
    memory per block), lookup and get latency, inspect, verify against fio's best random read,
    purge."""
    from tiercache.bench.benchscale import format_scale_report, run_scale_bench
    from tiercache.bench.fiospec import parse_size

    try:
        rep = run_scale_bench(_base(config, root), blocks=blocks or 100_000,
                              block_bytes=parse_size(bs, "--bs") if bs else 4096, scan=not no_baseline,
                              fio=not no_baseline, seed=seed, keep=keep, log=_log(output_format))
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_scale_report)


@bench_app.command("array")
def array_cmd(
    output_format: FormatOpt = OutputFormat.normal,
    root: Annotated[
        list[Path], typer.Option("--root", help="A directory on one device (repeatable: one per device of the array).")
    ] = ...,
    bs: Annotated[
        Optional[list[str]], typer.Option("--bs", help="Block size (repeatable; default 16k 64k 256k 2m).")
    ] = None,
    tiers: Annotated[
        Optional[list[str]],
        typer.Option("--tiers", help="Tier pair (repeatable; default host:file, and device:file with a GPU)."),
    ] = None,
    size: Annotated[str, typer.Option(help="Bytes per phase (per block size and direction).")] = "1g",
    iodepth: Annotated[int, typer.Option(help="Blocks in flight per fio-style job.", min=1, max=4096)] = 128,
    batch: Annotated[int, typer.Option(help="Blocks per request of the cache's path.", min=1, max=4096)] = 32,
    rows_per_job: Annotated[int, typer.Option(help="Rows per job of the row store.", min=1, max=4096)] = 32,
    numjobs: Annotated[int, typer.Option(help="Jobs (threads) per fio-style run.", min=1, max=64)] = 1,
    io_threads: Annotated[
        Optional[int],
        typer.Option(
            help="The file tier's I/O threads (default: one per request in flight, numjobs x iodepth / batch).",
            min=1,
            max=256,
        ),
    ] = None,
    fsync: Annotated[
        str, typer.Option(help="The file tier's fsync policy during the writes (none: as fio's end_fsync=1).")
    ] = "none",
    io_engine: Annotated[
        str,
        typer.Option(
            help="The file tier's io_engine on the tuned paths and the row store (auto, io_uring, threads, python)."
        ),
    ] = "auto",
    rowstore: Annotated[bool, typer.Option(help="Also the row store (the vLLM tier's path).")] = True,
    format_limit: Annotated[
        bool,
        typer.Option(
            help="Also the format's own limit (C threads: open, O_DIRECT write or read, close, rename; no "
                 "engine; a baseline, skipped with --no-baseline)."
        ),
    ] = True,
    plain_caller: Annotated[
        bool,
        typer.Option(help="Also a plain caller: TierCache with default settings, offload and get in fresh processes."),
    ] = True,
    repeat: _repeat_opt(1, "fio and tiercache, alternated") = 1,
    seed: SeedOpt = None,
    no_baseline: NoBaselineOpt = False,
) -> None:
    """The file tier over several devices (a root array, one --root per device) against fio's
    best over numjobs x iodepth on all of them at once, in the same run: the cache's offload
    and onboard (fio-style jobs), the row store's stores and loads, the format's own limit and
    a plain caller of the API, per block size."""
    from tiercache.bench.bencharray import DEFAULT_SIZES, format_array, run_array_bench
    from tiercache.bench.fiospec import parse_size
    from tiercache.cuda import cuda_status
    from tiercache.settings import FSYNC_POLICIES, IO_ENGINES

    if fsync not in FSYNC_POLICIES:
        _fail(f"--fsync {fsync!r}: choose one of {', '.join(FSYNC_POLICIES)}")
    if io_engine not in IO_ENGINES:
        _fail(f"--io-engine {io_engine!r}: choose one of {', '.join(IO_ENGINES)}")
    pairs = tuple(tiers) if tiers else ("host:file",) + (("device:file",) if cuda_status().available else ())
    try:
        sizes = tuple(parse_size(b, "--bs") for b in bs) if bs else DEFAULT_SIZES
        rep = run_array_bench(
            [Path(r) for r in root],
            block_sizes=sizes,
            tiers=pairs,
            total_bytes=parse_size(size, "--size"),
            iodepth=iodepth,
            batch=batch,
            per_job=rows_per_job,
            numjobs=numjobs,
            io_threads=io_threads,
            fsync=fsync,
            io_engine=io_engine,
            rowstore=rowstore,
            limit=format_limit,
            plain=plain_caller,
            fio=not no_baseline,
            repeat=repeat,
            seed=seed,
            log=_log(output_format),
        )
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_array)


@bench_app.command("hf")
def hf_cmd(
    output_format: FormatOpt = OutputFormat.normal,
    root: RootOpt = None,
    context: Annotated[
        Optional[list[int]],
        typer.Option(
            help="Context lengths in tokens (repeat; default 16384 and 32768; --quick 4096 and 8192).", min=64
        ),
    ] = None,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per run.", min=2, max=4096)] = 32,
    tokens_per_block: Annotated[int, typer.Option(help="TieredCache tokens_per_block.", min=1, max=65536)] = 1024,
    ring_layers: Annotated[
        Optional[list[int]],
        typer.Option(
            help="TieredCache ring_layers (repeat to run tiercache's modes once per value; default 2).", min=2, max=64
        ),
    ] = None,
    tails: Annotated[
        Optional[list[Tails]],
        typer.Option(
            help="TieredCache tails: host (pinned host memory) or device "
            "(VRAM); repeat to run tiercache's modes once per value; "
            "default host."
        ),
    ] = None,
    hf_mode: _strings_opt(
        "--hf-mode", "Modes to run (repeat; default all: plain, plain-h2d, offloaded, tiercache-host, tiercache-files)."
    ) = None,
    repeat: _repeat_opt(3, "medians of each mode's tokens/s") = 3,
    quick: QuickOpt = False,
) -> None:
    """transformers generate with its plain cache, its offloaded cache and tiercache's
    TieredCache (GPU), against the plain cache plus each layer's host -> device copy."""
    from tiercache.bench.benchhf import MODES, format_hf_report, run_hf_bench

    bad = sorted(set(hf_mode or ()) - set(MODES))
    if bad:
        _fail(f"--hf-mode {bad[0]!r}: expected one of {', '.join(MODES)}")
    try:
        ctx = tuple(context or ((4096, 8192) if quick else (16384, 32768)))
        rep = run_hf_bench(
            contexts=ctx,
            new_tokens=new_tokens,
            root=_base(None, root),
            tokens_per_block=tokens_per_block,
            ring_layers=tuple(ring_layers or (2,)),
            tails=tuple(t.value for t in tails or (Tails.host,)),
            modes=tuple(hf_mode or MODES),
            repeat=repeat,
            log=_log(output_format),
        )
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_hf_report)


@bench_app.command("sglang-storage")
def sglang_storage_cmd(
    output_format: FormatOpt = OutputFormat.normal,
    root: RootOpt = None,
    model: _strings_opt(
        "--model",
        "Model geometries (configs/models names or config.json paths; repeat; default llama-3.1-8b and tiny-llama).",
    ) = None,
    page_tokens: Annotated[
        int, typer.Option(help="Tokens per HiCache page (SGLang's --page-size).", min=1, max=4096)
    ] = 64,
    size: Annotated[
        Optional[str], typer.Option("--size", help="Bytes of pages per model (default 1g; --quick 64m).")
    ] = None,
    batch: Annotated[
        Optional[int],
        typer.Option(help="Pages per controller call [default: SGLang's own STORAGE_BATCH_SIZE, 128; "
                     "16 with --quick].", min=1, max=1024),
    ] = None,
    io_threads: Annotated[int, typer.Option(help="tiercache's I/O threads.", min=1, max=256)] = 16,
    seed: SeedOpt = None,
    no_baseline: NoBaselineOpt = False,
    quick: QuickOpt = False,
    keep: Annotated[bool, typer.Option(help="Keep the job's files.")] = False,
    array: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--array",
            help="A directory per device (repeat): tiercache "
            "over all (a root array), SGLang's file backend on the first, "
            "fio over all.",
        ),
    ] = None,
    zero_copy: Annotated[
        bool,
        typer.Option(help="tiercache's pages read and written in place (its zero_copy setting); "
                     "--no-zero-copy: through its staging rows, for comparison."),
    ] = True,
) -> None:
    """SGLang's own file HiCache backend and tiercache's, side by side on one directory, through
    SGLang's cache controller's page set and get calls: pages/s, GB/s, batch p50/p99, wrong
    pages, and fio's best at the page size."""
    from tiercache.bench.benchsglang import format_sglang_report, run_sglang_bench
    from tiercache.bench.fiospec import parse_size

    try:
        total = parse_size(size, "--size") if size else (64 << 20 if quick else 1 << 30)
        rep = run_sglang_bench(_base(None, root), models=tuple(model or ("llama-3.1-8b", "tiny-llama")),
                               page_tokens=page_tokens, total_bytes=total,
                               batch=batch if batch or not quick else 16, fio=not no_baseline,
                               fio_runtime=2.0 if quick else 5.0, io_threads=io_threads, seed=seed, keep=keep,
                               log=_log(output_format), array=list(array) if array else None,
                               zero_copy=zero_copy)
    except TierCacheError as exc:
        _fail(str(exc))
    _report(rep, output_format, format_sglang_report)
    if not rep["ok"]:
        raise typer.Exit(1)
