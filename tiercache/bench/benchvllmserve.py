"""``tiercache bench vllm-serve``: a real vLLM engine on the GPU, side by side with vLLM's own
KV tiers, on requests that share long prefixes.

The model is built from a ``config.json`` with random weights (``load_format="dummy"``, no
tokenizer, prompts as token ids): its KV bytes per token and its prefill work per token are the
real model's (``configs/models/``). The workload is ``prefixes`` shared prefixes of
``prefix_tokens`` random tokens, each asked ``rounds`` times with a different suffix of
``suffix_tokens`` (a system prompt or a conversation reused by later turns), one request at a
time, greedy decoding of ``max_tokens`` tokens. Round 0 is *cold* (the prefix is new); later
rounds are *repeats*. The GPU's KV space holds one request (``num_gpu_blocks_override``) and
vLLM's CPU tier (``cpu_bytes_to_use``) 1.25 prefixes, so a repeat's prefix is no longer in either
when it comes back (every other prefix was asked in between): it comes from files, or it is
recomputed.

Each mode runs in its own engine process (:func:`worker_main`), one after the other:

- ``recompute``: no connector (vLLM's GPU prefix cache only);
- ``cpu``: vLLM's ``OffloadingConnector`` with its CPU tier alone;
- ``fs``: vLLM's ``TieringOffloadingSpec``, CPU tier and vLLM's own ``fs`` tier (blocking O_DIRECT
  writes and reads on 16 + 16 threads);
- ``tiercache``: ``TierCacheTieringSpec``, the same CPU tier and :class:`TierCacheTier`;
- ``tiercache-shared``: two engine processes at once on one shared root, each with half of the
  GPU's memory (or, with ``shared_gpus``, one GPU each): the first runs the cold round, drains
  its stores and stays up; the second runs the repeats, which must be hits on the first one's
  files;
- ``connector``: tiercache's own KV connector (files <-> vLLM's GPU blocks, no CPU tier), and
  ``connector-shared``: its pair of engines on one shared root, as ``tiercache-shared``.

``tensor_parallel``: every engine on that many GPUs (vLLM's ``tensor_parallel_size``). Each engine
steps until its connector has no store in flight before it reports (:func:`_drain_stores`).

and, with ``restart`` (default on): a fresh engine process on the roots the ``fs`` and
``tiercache`` modes left, running the repeats only (every prefix should come from files); with
``kill9``: an engine storing to a tiercache root is killed with SIGKILL in the middle of the cold
round, a fresh one runs every request on that root, and its tokens must equal the uninterrupted
``tiercache`` run's.

Per mode: TTFT (vLLM's ``first_token_latency`` of each request) p50 / p99 of cold requests and
of repeats, requests/s, the prompt tokens each source served (vLLM's ``prompt_tokens_by_source``:
GPU prefix cache, connector, computed; the connector's split into files and CPU by counting the
chunks the secondary tier's ``submit_load`` was given), tokens against recompute's and against
vLLM's own tiers', and ``tiercache verify`` of every tiercache root afterwards. The baselines in
the same run: fio's best random read at the chunk's file size on the same directory, the
pinned-host -> GPU copy rate, and a GPU prefix hit's TTFT (the suffix computed, the prefix not);
the bound for a repeat served from files is ``prefix KV bytes / fio read + prefix KV bytes /
host->GPU rate + GPU-hit TTFT``. The break-even against recompute is stated per model: KV bytes
per token / disk bandwidth against recompute's prefill seconds per token, on this disk and, by
arithmetic, on 7 and 14 GB/s NVMe drives.

vLLM must import (0.26 or later with a GPU build); the engine processes are started with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the scheduler, and so the tiers, in the worker process)
and ``PYTHONHASHSEED=0`` (vLLM's block hashes must agree across processes for a restart or a
second process to find the files: vLLM's ``NONE_HASH`` is random otherwise).
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiercache.bench.stagetrace import StageTrace, breakdown
from tiercache.errors import ConfigError, MissingDependencyError
from tiercache.resources import models_dir

#: the modes of one run, in order
MODES = ("recompute", "cpu", "fs", "tiercache", "connector", "tiercache-shared", "connector-shared")
#: where the model geometries live (``configs/models/<name>.json``)
MODELS_DIR = models_dir()
#: tokens per GPU block and per offloaded chunk (vLLM's default block size)
TOKENS_PER_CHUNK = 16
#: NVMe read rates for the break-even arithmetic (GB/s): one Gen4 and one Gen5 drive
NVME_GBPS = (7.0, 14.0)
#: the CPU tier holds this many prefixes (below the working set of ``prefixes``, above one request
#: plus the chunks its write-behind to files still pins)
CPU_TIER_PREFIXES = 2.0
_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false"}


# -- the model and the workload ------------------------------------------------------------------
def model_config(model: str) -> tuple[str, dict]:
    """``(name, config.json as a dict)`` of ``model``: a name in ``configs/models`` (without
    ``.json``), a ``.json`` file, or a directory holding ``config.json``.

    Raises:
        ConfigError: no such model, or not a JSON object.
    """
    p = Path(model)
    for path, name in ((p / "config.json", p.name), (p, p.stem), (MODELS_DIR / f"{model}.json", model)):
        if path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--model {model!r}: {path} is not a readable JSON file ({exc})") from None
            if not isinstance(cfg, dict) or "num_hidden_layers" not in cfg:
                raise ConfigError(f"--model {model!r}: {path} is not a model's config.json")
            return name, cfg
    known = ", ".join(sorted(x.stem for x in MODELS_DIR.glob("*.json")))
    raise ConfigError(f"--model {model!r}: no such model; give one of {known}, a config.json or its directory")


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token, bytes (bf16: 2 bytes per element)."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim(cfg) * dtype_bytes


def prefill_flops_per_token(cfg: dict, context: int) -> float:
    """FLOPs to prefill one token of a prompt of ``context`` tokens: 2 x the non-embedding
    parameters of the layers (projections and MLP) plus causal attention over half the context
    on average (4 x layers x heads x head_dim x context / 2)."""
    h, layers, d = cfg["hidden_size"], cfg["num_hidden_layers"], head_dim(cfg)
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    attention = 4 * layers * cfg["num_attention_heads"] * d * context / 2
    return 2.0 * layers * per_layer + attention


def workload(seed: int, vocab: int, prefixes: int, prefix_tokens: int, suffix_tokens: int,
             rounds: int) -> list[dict]:
    """The requests, in the order they are sent: round by round, every prefix in each round;
    each ``{"prefix": p, "round": r, "ids": [token ids]}`` (random ids in [100, vocab))."""
    rng = random.Random(seed)
    heads = [[rng.randrange(100, vocab) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    return [{"prefix": p, "round": r, "ids": heads[p] + [rng.randrange(100, vocab) for _ in range(suffix_tokens)]}
            for r in range(rounds) for p in range(prefixes)]


def tiercache_lines(log: str, limit: int = 40) -> list[str]:
    """tiercache's own lines in an engine's log (its warnings and errors: the worker's start-up
    line is info; a missing copy kernel or a failed load is a warning), the first ``limit``."""
    return [line for line in log.splitlines() if "tiercache:" in line][:limit]


def kv_transfer(mode: str, root: Path | None, cpu_bytes: int, connector_settings: dict | None = None) -> dict | None:
    """The ``kv_transfer_config`` of ``mode`` (None: no connector); ``connector_settings``:
    more keys of tiercache's connector's ``kv_connector_extra_config``."""
    if mode == "recompute":
        return None
    if mode.startswith("connector"):  # tiercache's own path: files <-> vLLM's GPU blocks, no CPU tier
        return {
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache.integrations.vllmconnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "root": str(root),
                "fsync": "none",
                "io_threads": 16,
                **({"sharing": "shared"} if mode.startswith("connector-shared") else {}),
                **(connector_settings or {}),
            },
        }
    extra: dict = {"cpu_bytes_to_use": int(cpu_bytes)}
    if mode == "fs":  # vLLM's fs tier, under the spec that guards vLLM 0.26's store after a request's end
        extra.update(spec_name="TierCacheTieringSpec", spec_module_path="tiercache.integrations.vllm",
                     secondary_tiers=[{"type": "fs", "root_dir": str(root)}])
    elif mode.startswith("tiercache"):
        # matched to the fs tier: no flush before a store is reported, and its 16 + 16 threads
        tier = {"type": "TierCacheTier", "root": str(root), "fsync": "none", "io_threads": 16}
        if mode.startswith("tiercache-shared"):
            tier["sharing"] = "shared"
        extra.update(spec_name="TierCacheTieringSpec", spec_module_path="tiercache.integrations.vllm",
                     secondary_tiers=[tier])
    elif mode != "cpu":
        raise ConfigError(f"vllm-serve mode {mode!r}; valid: {', '.join(MODES)}")
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


# -- one engine process ------------------------------------------------------------------------
def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _by_source(llm) -> dict[str, float]:
    try:
        return {m.labels.get("source"): float(m.value) for m in llm.get_metrics()
                if m.name == "vllm:prompt_tokens_by_source"}
    except Exception:  # metrics off or renamed: the split is left out, nothing else changes
        return {}


class _LoadCounter:
    """Chunks each secondary tier's ``submit_load`` was given (promotions from files), counted
    in this process (the scheduler runs here: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""

    def __init__(self) -> None:
        self.chunks = 0
        self.roots: list[str] = []
        self.workers: list = []  # the connector's workers in this process (their counters)
        classes = []
        try:
            from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

            classes.append(FileSystemTierManager)
        except ImportError:
            pass
        try:
            from tiercache.integrations.vllm import TierCacheTier
        except ImportError:  # an engine without vLLM's tiering code: nothing to count
            return
        classes.append(TierCacheTier)
        for cls in classes:
            self._wrap(cls)
        self._wrap_connector()
        init = TierCacheTier.__init__

        def tier_init(tier, *a, **kw):
            init(tier, *a, **kw)
            self.roots.append(str(tier.root))

        TierCacheTier.__init__ = tier_init

    def _wrap_connector(self) -> None:
        try:
            from tiercache.integrations.vllmconnector import ConnectorWorker
        except ImportError:  # no vLLM connector base in this engine
            return
        load, init = ConnectorWorker._load, ConnectorWorker.__init__

        def counted_load(worker, t):
            self.chunks += len(t.keys)
            return load(worker, t)

        def worker_init(worker, settings, roots):
            init(worker, settings, roots)
            self.roots.extend(str(r) for r in roots)
            self.workers.append(worker)

        ConnectorWorker._load, ConnectorWorker.__init__ = counted_load, worker_init

    def _wrap(self, cls) -> None:
        submit = cls.submit_load

        def submit_load(tier, job):
            self.chunks += len(job.keys)
            return submit(tier, job)

        cls.submit_load = submit_load


def _skipped_stores() -> list:
    """The managers TierCacheTieringSpec guards in this process (their
    ``tiercache_stores_skipped_after_finish`` counts the stores skipped for requests whose
    tiering state was already finalized)."""
    managers: list = []
    try:
        from tiercache.integrations import vllm as tc_vllm
    except ImportError:  # an engine without vLLM's tiering code
        return managers
    guard = tc_vllm.guard_stores_after_finish

    def recorded(manager) -> None:
        guard(manager)
        if manager not in managers:
            managers.append(manager)

    tc_vllm.guard_stores_after_finish = recorded
    return managers


def worker_main(spec_path: str) -> int:
    """One engine process: build the engine of ``spec["mode"]``, run ``spec["requests"]`` (indices
    into the workload) one at a time, write the measurements to ``spec["out"]``. With
    ``spec["progress"]``, append each finished request's index there (the kill test watches it);
    with ``spec["hold"]``, wait after the run until that file exists (the shared test's first
    process stays up while the second runs)."""
    spec = json.loads(Path(spec_path).read_text())
    counter = _LoadCounter() if spec["mode"] != "recompute" else None
    guarded = _skipped_stores()
    trace = StageTrace().install()  # before the engine: its classes are wrapped, not its instances
    from vllm import LLM, SamplingParams

    reqs = json.loads(Path(spec["workload"]).read_text())
    kw: dict = {}
    if spec.get("async_scheduling") is not None:
        kw["async_scheduling"] = spec["async_scheduling"]
    if spec["kv_transfer"] is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", seed=0, max_model_len=spec["max_model_len"], gpu_memory_utilization=spec["gpu_util"],
              num_gpu_blocks_override=spec["gpu_blocks"], max_num_seqs=4, enable_prefix_caching=True,
              disable_log_stats=False, tensor_parallel_size=spec.get("tensor_parallel", 1), **kw)
    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], detokenize=False)

    def one(ids: list[int]) -> tuple[float, float, list[int], int]:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        m = getattr(out, "metrics", None)
        ttft = getattr(m, "first_token_latency", 0.0) or 0.0
        return (ttft if ttft > 0 else wall), wall, list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    one([101 + (i % 1000) for i in range(64)])  # warm-up: kernels, allocator
    extra: dict = {}
    if spec.get("gpu_hit_probe"):  # GPU prefix hits: the same prefix, new suffixes, right away
        one(reqs[0]["ids"])
        extra.update(_gpu_hits(one, reqs[0]["ids"], spec["suffix_tokens"]))
        # the reference's first request must be computed in full, as every other mode's is: a
        # prefix left cached here would make its tokens those of a chunked prefill
        llm.reset_prefix_cache()
    rows = []
    t_run = time.perf_counter()
    damaged: list[str] | None = None
    last_round = None
    for i in spec["requests"]:
        r = reqs[i]
        if spec.get("round_gap_s") and last_round is not None and r["round"] != last_round:
            _idle(llm, spec["round_gap_s"])
        last_round = r["round"]
        if spec.get("damage") and damaged is None and r["round"] > 0:
            damaged = _damage_files(counter.roots if counter else [], spec["damage"])
        before, chunks0 = _by_source(llm), counter.chunks if counter else 0
        mark, submitted = trace.mark(), time.perf_counter()
        ttft, wall, toks, cached = one(r["ids"])
        stages = breakdown(trace.since(mark), submitted, submitted + ttft)
        after = _by_source(llm)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        rows.append({"index": i, "prefix": r["prefix"], "round": r["round"], "ttft_s": ttft, "wall_s": wall,
                     "tokens": toks, "prompt_tokens": len(r["ids"]), "cached_tokens": cached,
                     "gpu_tokens": delta.get("local_cache_hit"), "connector_tokens": delta.get("external_kv_transfer"),
                     "computed_tokens": delta.get("local_compute"),
                     "file_chunks": (counter.chunks - chunks0) if counter else 0, "stages": stages})
        if spec.get("progress"):
            with open(spec["progress"], "a") as f:
                f.write(f"{i}\n")
    run_s = time.perf_counter() - t_run
    if spec.get("gpu_hit_after") and rows:  # the same process's GPU hits: the last prompt's prefix is cached
        hits = _gpu_hits(one, reqs[spec["requests"][-1]]["ids"], spec["suffix_tokens"])
        extra["gpu_hit_after_ttft_s"], extra["gpu_hit_after_ttft_samples_s"] = hits.values()
    extra["drain_s"] = _drain_stores(llm)
    if spec.get("h2d_probe"):
        extra["h2d_gbps"] = _h2d_gbps()
    extra["traced"] = trace.installed
    if counter is not None and counter.workers:
        extra["connector_counters"] = dict(sum((w.counters for w in counter.workers), collections.Counter()))
        extra["connector_workers"] = [w.describe() for w in counter.workers]
    if damaged is not None:
        extra["damaged"] = damaged
    Path(spec["out"]).write_text(json.dumps({"mode": spec["mode"], "startup_s": startup, "run_s": run_s,
                                             "requests": rows, "tier_roots": counter.roots if counter else [],
                                             "stores_skipped_after_finish": sum(
                                                 getattr(m, "tiercache_stores_skipped_after_finish", 0) or 0
                                                 for m in guarded), **extra}))
    hold = spec.get("hold")
    if hold:
        while not Path(hold).exists():
            time.sleep(0.1)
    _shutdown(llm)
    return 0


#: GPU prefix hits a run times for the bound's GPU-hit TTFT (their median): one alone ranged
#: 36-96 ms over runs of one day on one H100 (Llama-3.1-8B, 8k prefixes)
GPU_HIT_PROBES = 5


def _gpu_hits(one, ids: list[int], suffix_tokens: int) -> dict:
    """TTFTs (seconds) of :data:`GPU_HIT_PROBES` prompts that share ``ids``' prefix (cached on
    the GPU: ``ids`` was just run) with a new suffix of ``suffix_tokens`` tokens each:
    ``{"gpu_hit_ttft_s": median, "gpu_hit_ttft_samples_s": [...]}``."""
    head = ids[:len(ids) - suffix_tokens]
    times = [one(head + [7 + ((i + 13 * k) % 90) for i in range(suffix_tokens)])[0] for k in range(GPU_HIT_PROBES)]
    return {"gpu_hit_ttft_s": statistics.median(times), "gpu_hit_ttft_samples_s": times}


def damage_file(path: str | os.PathLike, how: str) -> None:
    """Damage a block file as a failing disk or a careless hand would: ``"flip"`` inverts some
    bits of one data byte, ``"truncate"`` cuts the file inside its data, ``"delete"`` removes it.

    Raises:
        ValueError: another ``how``. OSError: the file cannot be changed.
    """
    if how == "flip":
        with open(path, "r+b") as fh:
            fh.seek(4096 + 1000)
            b = fh.read(1)
            fh.seek(4096 + 1000)
            fh.write(bytes([b[0] ^ 0x5A]))
    elif how == "truncate":
        os.truncate(path, 4096 + 512)
    elif how == "delete":
        os.unlink(path)
    else:
        raise ValueError(f"damage {how!r}: flip, truncate or delete")


def _damage_files(roots: list[str], seed: int) -> list[str]:
    """Between rounds: one block file under ``roots`` gets a byte flipped, one is truncated,
    one deleted (random ones, by ``seed``); returns what was done to which file."""
    files = sorted(str(p) for r in roots for p in Path(r).glob("[0-9a-f][0-9a-f]/block_*.bin"))
    picks = random.Random(seed).sample(files, min(3, len(files)))
    for how, f in zip(("flip", "truncate", "delete"), picks):
        damage_file(f, how)
    return [f"{how} {f}" for how, f in zip(("flip", "truncate", "delete"), picks)]


def _h2d_gbps(nbytes: int = 1 << 30, reps: int = 5) -> float | None:
    """Pinned host -> GPU copy rate (GB/s) through PyTorch, the median of ``reps`` copies of
    ``nbytes``; None without a GPU."""
    try:
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except Exception:  # noqa: BLE001 - no GPU (a stand-in engine)
        return None
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:]) / 1e9


def _idle(llm, seconds: float) -> None:
    """Leave an in-process engine idle for ``seconds`` between rounds, stepping it while its
    scheduler has work (a tier's stores of the round before, which an idle in-process engine
    would not move on: see :func:`_drain_stores`), so that the next round's reads do not share
    the storage with the writes of the round before."""
    end = time.perf_counter() + seconds
    try:
        engine = llm.llm_engine
        has_requests = engine.engine_core.engine_core.scheduler.has_requests
    except AttributeError:
        time.sleep(seconds)
        return
    while time.perf_counter() < end:
        if has_requests():
            engine.step()
        time.sleep(0.005)


def _drain_stores(llm, timeout_s: float = 300.0) -> float | None:
    """Step an in-process engine until its connector has no store in flight; returns the
    seconds it took (None: the engine has no in-process scheduler to ask, e.g. a multiprocess
    engine, whose own loop keeps stepping).

    ``LLM.generate`` returns once its requests finish, but the chunks of the last requests are
    still on their way: vLLM's scheduler hands a finished GPU -> CPU store to the secondary
    tiers only on a later step. ``vllm serve`` (and the multiprocess engine core) keeps stepping
    while ``scheduler.has_requests()`` says the connector has pending work; an idle in-process
    engine does not, so without this the last requests' chunks never reach the files (a second
    engine would recompute them).

    Raises:
        TimeoutError: stores still pending after ``timeout_s`` seconds.
    """
    try:
        engine = llm.llm_engine
        sched = engine.engine_core.engine_core.scheduler
        has_requests = sched.has_requests
    except AttributeError:
        return None
    t0 = time.perf_counter()
    while has_requests():
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"vllm-serve: the engine's connector still had stores in flight after {timeout_s} s")
        engine.step()
        time.sleep(0.001)
    return time.perf_counter() - t0


def _shutdown(llm) -> None:
    """Shut the in-process engine down (its connector closes the tiers: the root's index is
    saved), where the release offers a way."""
    for path in (("llm_engine", "engine_core", "shutdown"), ("llm_engine", "shutdown"), ("shutdown",)):
        obj = llm
        try:
            for name in path:
                obj = getattr(obj, name)
        except AttributeError:
            continue
        try:
            obj()
        except Exception:  # noqa: BLE001 - the measurements are written already
            pass
        return


# -- the run ---------------------------------------------------------------------------------
class _Run:
    """The files and processes of one ``run_serve_bench``."""

    def __init__(self, work: Path, model_dir: Path, workload_path: Path, common: dict, log) -> None:
        self.work, self.model_dir, self.workload_path, self.common, self.log = (
            work,
            model_dir,
            workload_path,
            common,
            log,
        )
        self.n = 0
        self._logs: dict[int, Path] = {}  # engine process id -> its log

    def spec(self, mode: str, requests: list[int], root: Path | None, **kw) -> dict:
        self.n += 1
        return {**self.common, "mode": mode, "requests": requests, "model_dir": str(self.model_dir),
                "workload": str(self.workload_path), "out": str(self.work / f"out-{self.n}-{mode}.json"),
                "kv_transfer": kv_transfer(mode.split("+")[0], root, self.common["cpu_bytes"],
                                           self.connector_settings(mode)), **kw}

    def connector_settings(self, mode: str) -> dict:
        """The connector's settings of ``mode``: the run's, and a variant's own over them."""
        variant = self.common.get("connector_variants", {}).get(mode.split("+")[0], {})
        return {**self.common.get("connector_settings", {}), **variant}

    def start(self, spec: dict) -> subprocess.Popen:
        path = self.work / f"spec-{self.n}.json"
        path.write_text(json.dumps(spec))
        env = {**os.environ, **_ENV}
        if spec.get("gpu") is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(spec["gpu"])
        log_path = self.work / f"engine-{self.n}-{spec['mode']}.log"
        errlog = open(log_path, "w")
        proc = subprocess.Popen([sys.executable, "-m", "tiercache.bench.benchvllmserve", str(path)], env=env,
                                stdout=errlog, stderr=subprocess.STDOUT)
        self._logs[proc.pid] = log_path
        return proc

    def finish(self, proc: subprocess.Popen, spec: dict, timeout: float = 1800) -> dict:
        rc = proc.wait(timeout)
        out = Path(spec["out"])
        if rc != 0 or not out.exists():
            tail = self._log_tail()
            raise ConfigError(f"vllm-serve: the {spec['mode']} engine exited {rc}; its log ends:\n{tail}")
        res = json.loads(out.read_text())
        log_path = self._logs.pop(proc.pid, None)
        res["tiercache_log"] = tiercache_lines(log_path.read_text(errors="replace")) if log_path else []
        return res

    def run(self, spec: dict) -> dict:
        self.log(f"  {spec['mode']}: engine process, {len(spec['requests'])} request(s)")
        return self.finish(self.start(spec), spec)

    def _log_tail(self) -> str:
        logs = sorted(self.work.glob("engine-*.log"), key=lambda p: p.stat().st_mtime)
        return logs[-1].read_text()[-4000:] if logs else "(no log)"


def _summary(res: dict, reference: dict[int, list[int]] | None, others: dict[str, dict[int, list[int]]],
             chunk_bytes: int, prefix_tokens: int, files_only: bool = False) -> dict:
    """One mode's row. ``files_only``: the mode's connector has no CPU tier (tiercache's own
    connector), so every connector token came from files, counted or not (a worker in another
    process, tensor parallel, is not counted)."""
    rows = res["requests"]
    cold = [r["ttft_s"] for r in rows if r["round"] == 0]
    rep = [r["ttft_s"] for r in rows if r["round"] > 0]
    reps = [r for r in rows if r["round"] > 0]

    def tot(key: str, rs) -> int | None:
        vals = [r[key] for r in rs if r[key] is not None]
        return int(sum(vals)) if vals else None

    out = {"startup_s": res["startup_s"], "requests": len(rows), "requests_per_s": len(rows) / res["run_s"],
           "ttft_cold_p50_s": _percentile(cold, 50), "ttft_cold_p99_s": _percentile(cold, 99),
           "ttft_repeat_p50_s": _percentile(rep, 50), "ttft_repeat_p99_s": _percentile(rep, 99)}
    # repeats whose whole prefix came through the connector (the engine recomputes some repeats:
    # a prefix whose stores vLLM dropped, or one it chose not to wait for)
    served = [r["ttft_s"] for r in reps if (r["connector_tokens"] or 0) >= prefix_tokens]
    out.update({"served_repeats": len(served), "ttft_served_repeat_p50_s": _percentile(served, 50),
                "ttft_served_repeat_p99_s": _percentile(served, 99)})
    file_tokens = sum(r["file_chunks"] for r in reps) * TOKENS_PER_CHUNK
    conn = tot("connector_tokens", reps)
    if files_only and conn is not None:
        file_tokens = conn
    out.update({"repeat_prompt_tokens": sum(r["prompt_tokens"] for r in reps),
                "repeat_gpu_tokens": tot("gpu_tokens", reps), "repeat_connector_tokens": conn,
                "repeat_file_tokens": file_tokens,
                "repeat_cpu_tokens": None if conn is None else max(0, conn - file_tokens),
                "repeat_computed_tokens": tot("computed_tokens", reps),
                "file_bytes_read": sum(r["file_chunks"] for r in rows) * chunk_bytes})
    out["per_request"] = [{k: r.get(k) for k in ("index", "prefix", "round", "ttft_s", "gpu_tokens", "connector_tokens",
                                                 "computed_tokens", "file_chunks", "stages")} for r in rows]
    out["stages_repeat_p50"] = stage_medians([r.get("stages") for r in reps])
    out["stages_cold_p50"] = stage_medians([r.get("stages") for r in rows if r["round"] == 0])
    out["stages_traced"] = res.get("traced")
    if res.get("connector_counters"):
        out["connector_counters"] = res["connector_counters"]
        out["connector_workers"] = res.get("connector_workers")
    if res.get("tiercache_log"):
        out["tiercache_log"] = res["tiercache_log"]
    toks = {r["index"]: r["tokens"] for r in rows}
    if reference is not None:
        out["same_tokens_as_recompute"] = sum(toks[i] == reference.get(i) for i in toks)
        for row in out["per_request"]:
            row["same_as_recompute"] = toks[row["index"]] == reference.get(row["index"])
    for name, other in others.items():
        out[f"same_tokens_as_{name}"] = sum(toks[i] == other.get(i) for i in toks if i in other)
    out["compared"] = len(toks)
    return out


#: the stages of a repeat's TTFT, in the order they happen (tiercache/bench/stagetrace.py)
STAGES = ("lookup_ms", "before_read_ms", "read_ms", "read_to_upload_ms", "upload_ms", "after_upload_ms",
          "load_ms", "after_load_ms", "prefill_ms", "idle_forward_ms", "steps")
#: what a cold request's stores cost (tiercache's connector)
STORE_STAGES = ("store_gather_ms", "blocks_freed_ms", "store_writes")


def stage_medians(stages: list[dict | None]) -> dict:
    """Per stage, the median over the requests that had it (``None`` where none had)."""
    out = {}
    for k in ("ttft_ms",) + STAGES + STORE_STAGES:
        vals = [st[k] for st in stages if st and st.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def _verify(root: str) -> dict:
    """``tiercache verify --root ROOT --json`` of one tier root."""
    p = subprocess.run([sys.executable, "-m", "tiercache.cli", "verify", "--root", root, "--json"],
                       capture_output=True, text=True, timeout=1800)
    try:
        rep = json.loads(p.stdout)
    except ValueError:
        return {"root": root, "exit": p.returncode, "error": (p.stderr or p.stdout)[-2000:]}
    return {"root": root, "exit": p.returncode, "checked": rep["checked"], "bad": len(rep["bad"]),
            "bad_files": rep["bad"][:10]}


def run_serve_bench(directory: Path, model: str = "llama-3.1-8b", modes: tuple[str, ...] = MODES,
                    prefixes: int = 4, prefix_tokens: int = 8192, suffix_tokens: int = 256, rounds: int = 3,
                    max_tokens: int = 8, restart: bool = True, kill9: bool = False, fio: bool = True,
                    seed: int | None = None, gpu_util: float = 0.9, keep: bool = False,
                    cpu_tier_prefixes: float = CPU_TIER_PREFIXES, tensor_parallel: int = 1,
                    shared_gpus: tuple[int, int] | None = None, damage: int | None = None,
                    connector_settings: dict | None = None, round_gap_s: float = 0.0,
                    connector_variants: list[dict] | None = None, async_scheduling: bool | None = None,
                    log=lambda s: None) -> dict:
    """Run the modes on ``model`` over files under ``directory`` (module docstring) and return
    the report: per mode its TTFTs, requests/s, tokens by source, token agreement and verify
    results (``cpu_tier_prefixes``: vLLM's CPU tier in prefixes' worth of KV;
    ``tensor_parallel``: GPUs per engine; ``shared_gpus``: the shared pair's two engines on
    these two GPUs instead of halves of one; ``damage``: a seed: before the first repeat, each
    engine on files flips a byte of one block file, truncates one and deletes one;
    ``connector_settings``: keys of the ``connector`` mode's ``kv_connector_extra_config``, over
    the bench's; ``connector_variants``: more connector modes in the same run, one per dict of
    settings over ``connector_settings`` (modes ``connector~1``, ``connector~2``, ... right after
    ``connector``, each on a root of its own; their rows give their speed over ``fs`` and over
    ``connector``: A/B of settings on one machine in one run); ``async_scheduling``: vLLM's
    async scheduling on or off in every engine (None: vLLM's default, on; off, the connector's
    ``load_mode = "auto"`` loads in the step that computes the suffix); ``round_gap_s``: seconds each
    engine stays idle before each round after the
    first, so that a round's reads do not share the storage with the writes of the round before:
    on a storage whose writes are slower than the rounds, 0 measures the repeats beside them);
    the baselines (fio's best read at the chunk's file size, host -> GPU rate, GPU-hit TTFT),
    the bound for a repeat from files, its ratio, and
    the break-even arithmetic.

    Units: seconds, bytes, tokens, GB/s (1e9 bytes per second).

    Raises:
        ConfigError: an unknown mode or model, sizes out of range, or an engine process that
            failed (its log's end is in the message).
        MissingDependencyError: vLLM does not import here.
    """
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"vllm-serve mode {bad[0]!r}; valid: {', '.join(MODES)}")
    variants = {f"connector~{i}": dict(v) for i, v in enumerate(connector_variants or (), 1)}
    for name, v in variants.items():
        if not v or "root" in v or "root" in (connector_settings or {}):
            raise ConfigError(f"vllm-serve: connector variant {name} = {v!r}: give one or more settings other than "
                              "'root' (each variant runs on a root of its own, so no --connector-set root either)")
    if variants:
        at = modes.index("connector") + 1 if "connector" in modes else len(modes)
        modes = tuple(modes[:at]) + tuple(variants) + tuple(modes[at:])
    if not 2 <= prefixes <= 64 or not 1 <= rounds <= 16 or not TOKENS_PER_CHUNK <= prefix_tokens <= 131072:
        raise ConfigError(f"vllm-serve: prefixes={prefixes} (valid 2..64), rounds={rounds} (1..16), "
                          f"prefix_tokens={prefix_tokens} ({TOKENS_PER_CHUNK}..131072)")
    probe = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, env={**os.environ, **_ENV})
    if probe.returncode != 0:
        raise MissingDependencyError(
            "tiercache bench vllm-serve needs vLLM with a GPU build (0.26 or later) importable: "
            + (probe.stderr.strip().splitlines() or ["?"])[-1]
        )
    name, cfg = model_config(model)
    seed = random.randrange(1 << 31) if seed is None else seed
    kv_tok = kv_bytes_per_token(cfg)
    chunk_bytes = kv_tok * TOKENS_PER_CHUNK
    prompt_len = prefix_tokens + suffix_tokens
    max_model_len = prompt_len + max_tokens + TOKENS_PER_CHUNK
    gpu_blocks = math.ceil(max_model_len / TOKENS_PER_CHUNK) + 8
    if not 1 <= tensor_parallel <= 8:
        raise ConfigError(f"vllm-serve: tensor_parallel={tensor_parallel} (valid 1..8)")
    if shared_gpus is not None and (len(shared_gpus) != 2 or shared_gpus[0] == shared_gpus[1]
                                    or min(shared_gpus) < 0 or tensor_parallel != 1):
        raise ConfigError(f"vllm-serve: shared_gpus={shared_gpus}: give two different GPU indices (with "
                          "tensor_parallel=1), one per engine of the shared pair")
    if not 0.1 <= cpu_tier_prefixes < prefixes:
        raise ConfigError(f"vllm-serve: cpu_tier_prefixes={cpu_tier_prefixes} must be in [0.1, {prefixes}) (below the "
                          "working set, so that repeats come from files)")
    cpu_bytes = int(cpu_tier_prefixes * prefix_tokens * kv_tok)
    directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"vllm-serve-{name}-", dir=directory))
    model_dir = work / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": max(
        cfg.get("max_position_embeddings", 0), max_model_len)}))
    reqs = workload(seed, cfg["vocab_size"], prefixes, prefix_tokens, suffix_tokens, rounds)
    wl = work / "workload.json"
    wl.write_text(json.dumps(reqs))
    common = {"max_model_len": max_model_len, "gpu_blocks": gpu_blocks, "cpu_bytes": cpu_bytes,
              "max_tokens": max_tokens, "suffix_tokens": suffix_tokens, "gpu_util": gpu_util,
              "tensor_parallel": tensor_parallel, "connector_settings": dict(connector_settings or {}),
              "connector_variants": variants, "round_gap_s": float(round_gap_s),
              "async_scheduling": async_scheduling}
    run = _Run(work, model_dir, wl, common, log)
    every = list(range(len(reqs)))
    cold = [i for i, r in enumerate(reqs) if r["round"] == 0]
    repeats = [i for i, r in enumerate(reqs) if r["round"] > 0]
    log(f"vllm-serve: {name}, {prefixes} prefixes x {prefix_tokens} tokens (+{suffix_tokens}), {rounds} rounds, "
        f"KV {kv_tok} B/token, chunk files of {chunk_bytes} B, GPU KV {gpu_blocks} blocks, CPU tier "
        f"{cpu_bytes / 2**30:.2f} GiB; work in {work}")
    report: dict = {"job": "vllm-serve", "model": name, "seed": seed, "directory": str(directory),
                    "prefixes": prefixes, "prefix_tokens": prefix_tokens, "suffix_tokens": suffix_tokens,
                    "rounds": rounds, "max_tokens": max_tokens, "kv_bytes_per_token": kv_tok,
                    "chunk_bytes": chunk_bytes, "gpu_kv_blocks": gpu_blocks, "cpu_tier_bytes": cpu_bytes,
                    "tensor_parallel": tensor_parallel, "shared_gpus": list(shared_gpus) if shared_gpus else None,
                    "connector_settings": dict(connector_settings or {}), "round_gap_s": float(round_gap_s),
                    "async_scheduling": async_scheduling,
                    "connector_variants": variants, "modes": {}, "experiments": {}}
    report["vllm"] = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "?"
    results, roots = _run_modes(run, modes, cold, repeats, every, restart, kill9, gpu_util, shared_gpus, damage, seed)
    # the baselines and the report
    report["modes"] = _mode_rows(results, roots, run.work, chunk_bytes, prefix_tokens, connector_settings)
    rec = results.get("recompute", {})
    report["gpu_hit_ttft_s"] = rec.get("gpu_hit_ttft_s")
    report["gpu_hit_ttft_samples_s"] = rec.get("gpu_hit_ttft_samples_s")
    report["h2d_gbps"] = rec.get("h2d_gbps")
    if fio:
        report["fio"] = _fio_read(work, connector_settings, chunk_bytes + 4096,
                                  min(8 << 30, prefixes * prefix_tokens * kv_tok), log)
    report.update(_bounds(report, cfg, results))
    report["ok"] = _ok(report)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        report["work"] = str(work)
    return report


def _fio_read(work: Path, connector_settings: dict | None, file_bytes: int, total_bytes: int, log) -> dict:
    """fio's best random read of ``file_bytes`` per I/O on the work directory, or over the
    members of the connector's root array (a connector over an array is bounded by it)."""
    from tiercache.bench.fiobase import best_fio

    array = (connector_settings or {}).get("root")
    where = [Path(r) for r in array] if isinstance(array, list) and len(array) > 1 else work
    log(
        f"  fio: best random read at the chunk's file size on "
        f"{'the array' if where is not work else 'the same directory'}"
    )
    out = best_fio(where, file_bytes, total_bytes, 5.0, ops=("read",))
    out["directories"] = [str(d) for d in (where if isinstance(where, list) else [where])]
    return out


def _run_modes(run: _Run, modes: tuple[str, ...], cold: list[int], repeats: list[int], every: list[int],
               restart: bool, kill9: bool, gpu_util: float, shared_gpus, damage: int | None,
               seed: int) -> tuple[dict[str, dict], dict[str, Path]]:
    """Every mode's engine process(es), then the restarted and killed ones: ``(results by mode,
    root by mode)``."""
    work = run.work
    results: dict[str, dict] = {}
    roots: dict[str, Path] = {}
    for mode in modes:
        root = work / f"root-{mode}"
        roots[mode] = root
        if mode.endswith("-shared"):
            results[mode] = _shared_pair(run, mode, root, cold, repeats, gpu_util, shared_gpus)
            continue
        extra = {"gpu_hit_probe": True, "h2d_probe": True} if mode == "recompute" else {"gpu_hit_after": True}
        if damage is not None and mode != "recompute":
            extra["damage"] = damage
        results[mode] = run.run(run.spec(mode, every, root, **extra))
    if restart:
        for mode in ("fs", "tiercache", "connector"):
            if mode in results:
                results[f"{mode}+restart"] = run.run(run.spec(f"{mode}+restart", repeats, roots[mode]))
    if kill9:
        for mode in [m for m in ("tiercache", "connector") if m in modes] or ["tiercache"]:
            results[f"{mode}+kill9"] = _kill9(run, mode, work / f"root-{mode}-kill9", cold, every, seed)
    return results, roots


def _mode_rows(results: dict[str, dict], roots: dict[str, Path], work: Path, chunk_bytes: int, prefix_tokens: int,
               connector_settings: dict | None) -> dict[str, dict]:
    """Each mode's row of the report (:func:`_summary`), its roots verified."""
    rows: dict[str, dict] = {}
    ref = {r["index"]: r["tokens"] for r in results["recompute"]["requests"]} if "recompute" in results else None
    own = {m: {r["index"]: r["tokens"] for r in results[m]["requests"]} for m in ("cpu", "fs") if m in results}
    for mode, res in results.items():
        s = _summary(res, ref, {k: v for k, v in own.items() if k != mode}, chunk_bytes, prefix_tokens,
                     files_only=mode.startswith("connector"))
        tier_roots = res.get("tier_roots")
        if not tier_roots and mode.startswith("connector"):  # workers in processes of their own: by name
            base = (connector_settings or {}).get("root") or str(roots.get(mode.split("+")[0], work / f"root-{mode}"))
            if mode.endswith("+kill9"):
                base = str(work / f"root-{mode.split('+')[0]}-kill9")
            tier_roots = [str(p) for b in (base if isinstance(base, list) else [base]) for p in Path(b).glob("*_c_r*")]
        if tier_roots:
            s["verify"] = [_verify(r) for r in sorted(set(tier_roots))]
        for k in ("killed_after", "kill_detail", "stores_skipped_after_finish", "drain_s", "damaged",
                  "gpu_hit_after_ttft_s", "gpu_hit_after_ttft_samples_s"):
            if k in res:
                s[k] = res[k]
        rows[mode] = s
    return rows


def _shared_pair(run: _Run, mode: str, root: Path, cold: list[int], repeats: list[int], gpu_util: float,
                 gpus: tuple[int, int] | None = None) -> dict:
    """Two engine processes of ``mode`` (``tiercache-shared``: the tier; ``connector-shared``:
    the connector) at once on one shared root: A runs the cold round and stays up; B
    runs the repeats. Both on one GPU, each with half ``gpu_util``; or, with ``gpus``, A on the
    first GPU and B on the second, each with ``gpu_util``. Returns B's measurements with A's cold
    requests in front (one mode row)."""
    hold = run.work / "shared-release"
    each = {"gpu_util": gpu_util / 2} if gpus is None else {"gpu_util": gpu_util, "gpu": gpus[0]}
    a = run.spec(mode, cold, root, hold=str(hold), **each)
    pa = run.start(a)
    run.log(f"  {mode}: engine A, {len(cold)} cold request(s), stays up")
    deadline = time.monotonic() + 1800
    while not Path(a["out"]).exists():
        if pa.poll() is not None or time.monotonic() > deadline:
            hold.touch()
            return run.finish(pa, a)
        time.sleep(0.5)
    run.log(f"  {mode}: engine B beside it, {len(repeats)} repeat(s)")
    try:
        if gpus is not None:
            each["gpu"] = gpus[1]
        sb = run.spec(mode, repeats, root, **each)
        b = run.finish(run.start(sb), sb)
    finally:
        hold.touch()
    ra = run.finish(pa, a)
    return {"startup_s": max(ra["startup_s"], b["startup_s"]), "run_s": ra["run_s"] + b["run_s"],
            "requests": ra["requests"] + b["requests"], "tier_roots": ra["tier_roots"] + b["tier_roots"],
            "drain_s": ra.get("drain_s")}


def _kill9(run: _Run, mode: str, root: Path, cold: list[int], every: list[int], seed: int) -> dict:
    """SIGKILL an engine of ``mode`` (``tiercache`` or ``connector``) in the middle of its cold
    round (after a random number of finished requests, a random moment into the next one,
    while its blocks are being stored), then run every request on a fresh engine over the
    same root."""
    rng = random.Random(seed + 9)
    progress = run.work / f"kill9-progress-{mode}"
    after = rng.randrange(1, max(2, len(cold)))
    spec = run.spec(f"{mode}+kill9", cold, root, progress=str(progress))
    p = run.start(spec)
    run.log(f"  {mode}+kill9: killing the engine after {after} request(s)")
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline and p.poll() is None:
        if progress.exists() and len(progress.read_text().split()) >= after:
            break
        time.sleep(0.05)
    delay = rng.uniform(0.05, 0.5)
    time.sleep(delay)
    done = len(progress.read_text().split()) if progress.exists() else 0
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    p.wait()
    res = run.run(run.spec(f"{mode}+kill9", every, root))
    res["killed_after"] = done
    res["kill_detail"] = f"SIGKILL {delay:.2f} s after request {after} finished ({done} done when it fell)"
    return res


def _bounds(report: dict, cfg: dict, results: dict) -> dict:
    """The bound for a repeat from files, the ratio reached, and the break-even arithmetic."""
    out: dict = {}
    kv_prefix = report["prefix_tokens"] * report["kv_bytes_per_token"]
    read = (report.get("fio") or {}).get("read_gbps")
    h2d, gpu_hit = report.get("h2d_gbps"), report.get("gpu_hit_ttft_s")
    if read and h2d and gpu_hit is not None:
        bound = kv_prefix / (read * 1e9) + kv_prefix / (h2d * 1e9) + gpu_hit
        out["file_hit_bound_s"] = bound
        for mode in ("fs", "tiercache", "connector", "fs+restart", "tiercache+restart", "connector+restart",
                     "tiercache-shared", "connector-shared", *report.get("connector_variants", {})):
            m = report["modes"].get(mode)
            if m and m.get("ttft_repeat_p50_s"):
                m["bound_over_ttft"] = bound / m["ttft_repeat_p50_s"]
                if m.get("gpu_hit_after_ttft_s") is not None:  # the bound with this process's own GPU hits
                    own = bound - gpu_hit + m["gpu_hit_after_ttft_s"]
                    m["bound_own_gpu_hit_over_ttft"] = own / m["ttft_repeat_p50_s"]
    rec = report["modes"].get("recompute")
    if rec and rec.get("ttft_cold_p50_s"):
        per_token = rec["ttft_cold_p50_s"] / (report["prefix_tokens"] + report["suffix_tokens"])
        out["prefill_s_per_token"] = per_token
        out["prefill_tflops"] = prefill_flops_per_token(cfg, report["prefix_tokens"] + report["suffix_tokens"]) \
            / per_token / 1e12
        # reading a token's KV at R GB/s costs kv/R; recompute costs per_token: files win above
        out["break_even_gbps"] = report["kv_bytes_per_token"] / per_token / 1e9
        disks = {"this disk (fio's best read)": read} if read else {}
        disks.update({f"NVMe {g:g} GB/s": g for g in NVME_GBPS})
        out["read_over_recompute"] = {k: (report["kv_bytes_per_token"] / (g * 1e9)) / per_token
                                      for k, g in disks.items()}
    fs, cn = report["modes"].get("fs"), report["modes"].get("connector")
    if fs and cn and fs.get("ttft_repeat_p50_s") and cn.get("ttft_repeat_p50_s"):
        out["connector_over_fs_speed"] = fs["ttft_repeat_p50_s"] / cn["ttft_repeat_p50_s"]
    for name in report.get("connector_variants", {}):  # each variant's speed over fs and the connector's own
        v = report["modes"].get(name)
        for base, key in ((fs, "over_fs_speed"), (cn, "over_connector_speed")):
            if v and base and base.get("ttft_repeat_p50_s") and v.get("ttft_repeat_p50_s"):
                v[key] = base["ttft_repeat_p50_s"] / v["ttft_repeat_p50_s"]
    fs, tc = report["modes"].get("fs"), report["modes"].get("tiercache")
    if fs and tc and fs.get("ttft_repeat_p50_s") and tc.get("ttft_repeat_p50_s"):
        out["tiercache_over_fs_speed"] = fs["ttft_repeat_p50_s"] / tc["ttft_repeat_p50_s"]
    if fs and tc and fs.get("ttft_served_repeat_p50_s") and tc.get("ttft_served_repeat_p50_s"):
        out["tiercache_over_fs_served_speed"] = {
            q: fs[f"ttft_served_repeat_{q}_s"] / tc[f"ttft_served_repeat_{q}_s"] for q in ("p50", "p99")}
    return out


def _ok(report: dict) -> bool:
    """Every engine ran and every verified root is clean. (Token agreement across modes is
    reported, not judged: with random weights the logits are nearly flat, so a bf16 difference
    between prefilling with and without a cached prefix may flip a token.)"""
    for mode, m in report["modes"].items():
        for v in m.get("verify", ()):
            if v.get("exit") != 0 or v.get("bad"):
                return False
    return True


# -- the text report ---------------------------------------------------------------------------
def format_serve_report(rep: dict) -> str:
    """The report as text: one row per mode, then the baselines, the bound and the break-even."""
    ms = lambda x: "-" if x is None else f"{x * 1e3:8.1f}"  # noqa: E731
    lines = [f"tiercache vllm-serve: {rep['model']} (vLLM {rep['vllm']}), {rep['prefixes']} prefixes x "
             f"{rep['prefix_tokens']} tokens + {rep['suffix_tokens']}, {rep['rounds']} rounds, {rep['max_tokens']} "
             f"tokens each; KV {rep['kv_bytes_per_token']} B/token; seed {rep['seed']}",
             f"{'mode':<20}{'cold p50':>9}{'p99':>9}{'rep p50':>9}{'p99':>9} ms {'req/s':>6} "
             f"{'GPU':>6}{'CPU':>7}{'files':>7}{'comp':>7} tok  {'=rec':>5}{'=cpu':>5}{'=fs':>5} verify"]
    for mode, m in rep["modes"].items():
        def n(k):
            v = m.get(k)
            return "-" if v is None else str(v)

        ver = m.get("verify")
        vtxt = "-" if not ver else ", ".join(f"{v.get('checked', '?')} files {v.get('bad', '?')} bad" for v in ver)
        lines.append(f"{mode:<20}{ms(m['ttft_cold_p50_s'])}{ms(m['ttft_cold_p99_s'])}{ms(m['ttft_repeat_p50_s'])}"
                     f"{ms(m['ttft_repeat_p99_s'])}    {m['requests_per_s']:6.2f} {n('repeat_gpu_tokens'):>6}"
                     f"{n('repeat_cpu_tokens'):>7}{n('repeat_file_tokens'):>7}{n('repeat_computed_tokens'):>7}     "
                     f"{n('same_tokens_as_recompute'):>5}{n('same_tokens_as_cpu'):>5}{n('same_tokens_as_fs'):>5}"
                     f" {vtxt}")
    staged = {mode: m["stages_repeat_p50"] for mode, m in rep["modes"].items() if m.get("stages_repeat_p50")}
    if staged:
        lines.append("repeat TTFT by stage, medians in ms (bench/stagetrace.py): " + "  ".join(
            k.removesuffix("_ms") for k in ("ttft_ms",) + STAGES))
        for mode, st in staged.items():
            lines.append(f"  {mode:<18}" + "  ".join("-" if st.get(k) is None else f"{st[k]:.1f}"
                                                     for k in ("ttft_ms",) + STAGES))
    cold = {mode: m["stages_cold_p50"] for mode, m in rep["modes"].items()
            if (m.get("stages_cold_p50") or {}).get("store_gather_ms") is not None}
    if cold:
        keys = ("ttft_ms", "prefill_ms", "idle_forward_ms", "steps") + STORE_STAGES
        lines.append("cold TTFT by stage, medians in ms: " + "  ".join(k.removesuffix("_ms") for k in keys))
        for mode, st in cold.items():
            lines.append(f"  {mode:<18}" + "  ".join("-" if st.get(k) is None else f"{st[k]:.1f}" for k in keys))
    lines.append("(token columns: prompt tokens of the repeats by source; =rec/=cpu/=fs: requests whose tokens "
                 f"equal that mode's, of {next(iter(rep['modes'].values()))['compared'] if rep['modes'] else 0})")
    fio = rep.get("fio") or {}
    if fio.get("read_gbps"):
        lines.append(f"fio best random read at {rep['chunk_bytes'] + 4096} B: {fio['read_gbps']:.2f} GB/s "
                     f"({fio.get('read_config')})")
    if rep.get("h2d_gbps"):
        samples = rep.get("gpu_hit_ttft_samples_s") or []
        lines.append(f"pinned host -> GPU: {rep['h2d_gbps']:.1f} GB/s; GPU prefix hit TTFT "
                     f"{ms(rep.get('gpu_hit_ttft_s')).strip()} ms"
                     + (f" (median of {len(samples)}: {min(samples) * 1e3:.1f}-{max(samples) * 1e3:.1f})"
                        if samples else ""))
        own = ", ".join(f"{k} {m['gpu_hit_after_ttft_s'] * 1e3:.1f} ms (bound {m['bound_own_gpu_hit_over_ttft']:.2f})"
                        for k, m in rep["modes"].items() if "bound_own_gpu_hit_over_ttft" in m)
        if own:
            lines.append(f"each process's own GPU prefix hits after its rounds: {own}")
    if rep.get("file_hit_bound_s"):
        ratios = ", ".join(f"{k} {m['bound_over_ttft']:.2f}" for k, m in rep["modes"].items() if "bound_over_ttft" in m)
        lines.append(
            f"bound for a repeat from files: {rep['file_hit_bound_s'] * 1e3:.1f} ms; bound / repeat p50: {ratios}"
        )
    if rep.get("connector_over_fs_speed"):
        lines.append(f"connector (tiercache's own path) vs fs tier, repeat TTFT p50 (speed ratio): "
                     f"{rep['connector_over_fs_speed']:.2f}")
    for name, v in (rep.get("connector_variants") or {}).items():
        m = rep["modes"].get(name, {})
        speeds = ", ".join(f"{k.removesuffix('_speed').replace('_', ' ')} {m[k]:.2f}"
                           for k in ("over_connector_speed", "over_fs_speed") if k in m)
        lines.append(f"{name} ({', '.join(f'{k}={x}' for k, x in v.items())}): repeat TTFT p50 speed {speeds or '-'}")
    if rep.get("tiercache_over_fs_speed"):
        lines.append(f"tiercache vs fs tier, repeat TTFT p50 (speed ratio): {rep['tiercache_over_fs_speed']:.2f}")
    if rep.get("tiercache_over_fs_served_speed"):
        sv = rep["tiercache_over_fs_served_speed"]
        lines.append("repeats served through the connector, TTFT p50 / p99 ms: " + "; ".join(
            f"{k} {ms(m['ttft_served_repeat_p50_s']).strip()} / {ms(m['ttft_served_repeat_p99_s']).strip()} "
            f"({m['served_repeats']})" for k, m in rep["modes"].items() if m.get("served_repeats"))
            + f"; tiercache vs fs speed p50 {sv['p50']:.2f}, p99 {sv['p99']:.2f}")
    if rep.get("break_even_gbps"):
        lines.append(
            f"recompute: {rep['prefill_s_per_token'] * 1e6:.1f} us/token ({rep['prefill_tflops']:.0f} TFLOP/s); "
            f"reading the KV beats it above {rep['break_even_gbps']:.2f} GB/s; read/recompute time: "
            + ", ".join(f"{k} {v:.2f}" for k, v in rep["read_over_recompute"].items())
        )
    lines.append("ok" if rep["ok"] else "NOT OK (a verify found bad files or failed)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
