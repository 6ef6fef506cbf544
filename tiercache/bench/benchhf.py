"""The transformers benchmark: one random-weight model generating from one prompt with (a) the
plain ``DynamicCache``, (b) transformers' own offloading (``cache_implementation="offloaded"``:
each layer's KV on the CPU, the next layer prefetched on a side stream), (c) tiercache's
:class:`~tiercache.integrations.transformers.TieredCache` with its host tier, and (d) the
same with a host tier smaller than the KV and the rest in block files, in one run on one GPU.
A ceiling runs beside them: ``plain-h2d``, the plain cache plus the host -> device copies any
cache that streams the KV from host memory must make, and nothing else
(:class:`StreamingCeiling`); tiercache's modes report their tokens/s as paired ratios to the
plain cache's and to that ceiling's (``vs_plain``, ``vs_ceiling``: medians over the passes of
each pass's ratio).

Per mode and context length: time to first token (the prefill), decode tokens/s (steps after
the first), peak VRAM above the weights (``torch.cuda.max_memory_allocated``; over the whole
run, set by the prefill's activations, and over the decode steps alone, where the KV cache's own
VRAM dominates), tiercache's host time in ``update`` per step, the host's wait for the GPU
after issuing a step (near zero when the host bounds the step), pinned host
memory, and whether the tokens equal (a)'s. The PCIe bound of a step is the KV bytes it must
bring to the GPU (every layer's keys and values of the whole context, at the context's mean
length over the decode steps) over a contiguous pinned host-to-device copy's bandwidth
measured in the same run; a mode's share of it is its tokens/s over that bound. The files
mode reports the bytes per second it read from files beside fio's random-read bandwidth on
the same directory with the same file size (when fio is installed).

The model is built from a config (Llama-3.2-1B's geometry by default: 16 layers, hidden 2048,
32 heads, 8 KV heads, head_dim 64, bf16); nothing is downloaded.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import time
from pathlib import Path

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                    max_position_embeddings=131072, tie_word_embeddings=True)
MODES = ("plain", "plain-h2d", "offloaded", "tiercache-host", "tiercache-files")
#: bf16 logits of two runs that see the same KV bytes may differ by kernel choice (split-K,
#: attention over a strided or a contiguous cache); a mode passes when its tokens equal the plain
#: cache's, or its logits stay within this up to the first step whose token differs
LOGIT_TOLERANCE = 0.5


def h2d_gbps(torch, nbytes: int = 512 << 20, reps: int = 10) -> float:
    """Contiguous pinned host -> device copy bandwidth (GB/s, median of ``reps``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times = sorted(times[2:])
    return nbytes / times[len(times) // 2] / 1e9


class StreamingCeiling:
    """The ``plain-h2d`` mode: the plain cache, plus the copies a layer-streaming host-tier
    cache cannot avoid, and nothing else. Each layer's KV bytes at the current length (``K +
    V``, ``bytes_per_token_layer`` each token) are copied host -> device (one
    ``cudaMemcpyAsync`` from pinned memory, the host tier's kind) into a ring of two scratch
    buffers, queued on a side stream right after the attention two layers back (a forward
    pre-hook on its ``o_proj``) and waited for on the compute stream before the layer (a
    pre-hook on the decoder layer). Nothing reads the scratch: what the mode measures is what
    the bytes cost the step on this machine (PCIe time, and the host's own slowdown while DMA
    reads its memory), the ceiling of any cache that streams the KV from host memory every
    step. Remove the hooks with :meth:`close`."""

    def __init__(self, torch, model, cache, bytes_per_token_layer: int, max_tokens: int) -> None:
        import cupy

        from tiercache.memory import alloc_host

        layers = list(model.model.layers)
        self._n = len(layers)
        self._cache, self._per = cache, bytes_per_token_layer
        size = bytes_per_token_layer * max_tokens
        self._host, self._owner = alloc_host(size, pinned=True, huge_pages="auto")
        self._scratch = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self._side = cupy.cuda.Stream(non_blocking=True)
        self._after = [cupy.cuda.Event(disable_timing=True) for _ in range(self._n)]
        self._done = [cupy.cuda.Event(disable_timing=True) for _ in range(self._n)]
        self._queued = [False] * self._n
        self._torch = torch
        self._hooks = [layer.register_forward_pre_hook(self._before(i)) for i, layer in enumerate(layers)]
        self._hooks += [layer.self_attn.o_proj.register_forward_pre_hook(self._after_attention(i))
                        for i, layer in enumerate(layers)]

    def _compute(self):
        from tiercache.memory import as_cupy_stream

        return as_cupy_stream(int(self._torch.cuda.current_stream().cuda_stream))  # wrapped once per handle

    def _before(self, i: int):
        def hook(*_):
            if self._queued[i]:  # the layer's bytes were queued two attentions back: wait for them
                self._compute().wait_event(self._done[i])
                self._queued[i] = False
        return hook

    def _after_attention(self, i: int):
        def hook(*_):
            import cupy

            j = (i + 2) % self._n  # the layer whose bytes go into the buffer layer i's attention freed
            n = self._per * max(self._cache.get_seq_length(0), 1)
            self._after[i].record(self._compute())
            self._side.wait_event(self._after[i])
            cupy.cuda.runtime.memcpyAsync(self._scratch[j % 2].data_ptr(), self._host.ctypes.data, n, 1,
                                          self._side.ptr)
            self._done[j].record(self._side)
            self._queued[j] = True
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._side.synchronize()


def _pinned_bytes(torch) -> int:
    """Peak bytes of PyTorch's pinned host allocator (0 where it reports nothing)."""
    try:
        st = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return 0
    return int(st.get("allocated_bytes.all.peak", st.get("reserved_bytes.all.peak", 0)))


def _timed_generate(torch, model, ids, new_tokens: int, cache=None, **kw) -> dict:
    """Generate greedily, stamping the time after every step's logits and keeping them (float32,
    on the CPU). No attention mask is passed (one unpadded sequence per row, as a user calls
    it): with an all-ones mask, transformers builds a mask for every step and the plain cache
    decoded 2.5x slower at 16k (17 against 43 tokens/s on the H100 machine)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []
    waits: list[float] = []  # per step: the host's wait for the GPU once the step was issued
    forward: list[float] = []  # per step: host time inside the model's forward (issuing it)
    logits: list = []
    first: dict = {}

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            issued = time.perf_counter()
            # the compute stream, as generate's own syncs wait for it (a device-wide sync would
            # also wait for a cache's prefetch of the next step's first layers), and before
            # the logits' copy to the host, which would wait itself
            torch.cuda.current_stream().synchronize()
            waits.append(time.perf_counter() - issued)
            logits.append(scores.float().cpu())
            stamps.append(time.perf_counter())
            if len(stamps) == 1:  # the prefill's peak; from here the decode's
                first["peak"] = torch.cuda.max_memory_allocated()
                first["update_s"] = getattr(cache, "update_seconds", 0.0)
                torch.cuda.reset_peak_memory_stats()
            return scores

    began: list[float] = []
    hooks = [model.register_forward_pre_hook(lambda *a: began.append(time.perf_counter())),
             model.register_forward_hook(lambda *a: forward.append(time.perf_counter() - began[-1]))]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, logits_processor=LogitsProcessorList([Stamp()]), **kw)
    finally:
        for h in hooks:
            h.remove()
    steps = len(stamps) - 1
    decode = steps / (stamps[-1] - stamps[0]) if steps else 0.0
    median = (lambda xs: sorted(xs)[len(xs) // 2] * 1e3 if xs else 0.0)
    rec = {"tokens": out, "logits": logits, "ttft_s": stamps[0] - t0, "decode_tok_s": decode,
           "prefill_peak": first.get("peak", 0), "decode_peak": torch.cuda.max_memory_allocated(),
           # near 0: the host bounds the step (the GPU waits for it); near the step time: the GPU does
           "gpu_wait_ms_per_step": median(waits[1:]),
           # the rest of a step (generate's own host work: inputs, logits, stopping) leaves the
           # GPU idle but for transfers queued ahead
           "forward_host_ms_per_step": median(forward[1:]),
           "step_ms": median([b - a for a, b in zip(stamps, stamps[1:])])}
    if cache is not None and steps:  # update() is called once per layer and step: its host time per step
        rec["cache_host_ms_per_step"] = (cache.update_seconds - first["update_s"]) / steps * 1e3
    return rec


def _finite_diff(torch, x, y) -> float:
    """Largest absolute difference where both logits are finite (the logits processors set
    some to -inf, the same ones in both runs); inf where only one of them is finite."""
    fx, fy = torch.isfinite(x), torch.isfinite(y)
    if not torch.equal(fx, fy):
        return float("inf")
    return float((x[fx] - y[fy]).abs().max()) if bool(fx.any()) else 0.0


def compare_to_reference(torch, ref: dict, run: dict, prompt: int) -> dict:
    """Tokens and logits of ``run`` against the plain cache's ``ref``: ``identical`` (every
    generated token), ``first_divergence`` (the first step whose token differs, None if none)
    and ``max_logit_diff`` (largest absolute difference of the logits over the steps up to
    and including it, where both runs had the same tokens so far)."""
    a, b = ref["tokens"][:, prompt:], run["tokens"][:, prompt:]
    n = min(a.shape[1], b.shape[1])
    diff = (a[:, :n] != b[:, :n]).any(dim=0).nonzero()
    first = int(diff[0]) if diff.numel() else None
    upto = n if first is None else first + 1
    worst = max((_finite_diff(torch, x, y) for x, y in zip(ref["logits"][:upto], run["logits"][:upto])),
                default=0.0)
    return {"identical": first is None, "first_divergence": first, "max_logit_diff": worst}


def run_hf_bench(contexts=(16384, 32768), new_tokens: int = 32, batch: int = 1, modes=MODES, root: Path | None = None,
                 files_context: int | None = None, files_new_tokens: int = 8, host_fraction: float = 0.4,
                 tokens_per_block: int = 1024, ring_layers: int | tuple[int, ...] = 2, tails=("host",),
                 geometry: dict | None = None,
                 seed: int = 0, repeat: int = 3, log=lambda s: None) -> dict:
    """Run every mode at every context length (prompt = context - new tokens): once cold, then
    ``repeat`` passes over the modes in rotated orders; each mode reports its median pass.

    Args:
        contexts: total tokens per sequence (prompt and generated).
        new_tokens: tokens generated per run (decode tokens/s over the steps after the first).
        batch: sequences per run.
        modes: any of :data:`MODES`.
        root: directory for the files mode (required for it).
        files_context: the files mode's context (default: the smallest of ``contexts``);
            it generates ``files_new_tokens``.
        host_fraction: the files mode's host tier as a fraction of the KV (0.4: the KV is
            2.5x the host tier).
        tokens_per_block, ring_layers: :class:`TieredCache` settings; several ``ring_layers``
            run every tiercache mode once per value (the VRAM the ring takes against the layers
            prefetched ahead).
        tails: :class:`TieredCache` ``tails`` values (``"host"``, ``"device"``); every
            tiercache mode runs once per value and ring size.
        geometry: ``LlamaConfig`` fields (default :data:`LLAMA_3_2_1B`).
        repeat: measured passes (>= 1; the cold pass comes on top). A run's record is its
            median pass's (by decode tokens/s), with every pass's tokens/s in
            ``decode_tok_s_passes``; ``identical``/``first_divergence``/``max_logit_diff`` are
            the worst over its passes.

    Returns:
        ``{"h2d_gbps", "kv_bytes_per_token", "ring_layers", "tails", "runs": [{mode, context,
        ttft_s, decode_tok_s, pcie_bound_tok_s, share_of_bound, vs_plain, vs_ceiling,
        peak_vram_bytes, pinned_bytes, identical, ring_layers, tails, ...}], "ok"}``; ``ok``:
        every tiercache (and plain) run's tokens equal the first plain run's, or its logits stay
        within :data:`LOGIT_TOLERANCE` up to the first differing token (the offloaded peer's
        rows report its own divergence without judging it).

    Raises:
        MissingDependencyError: no torch/transformers. TierUnavailableError: no GPU.
    """
    from tiercache.errors import ConfigError, MissingDependencyError, TierUnavailableError

    try:
        import torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

        from tiercache.integrations.transformers import TieredCache, kv_bytes_per_token
    except ImportError as exc:
        raise MissingDependencyError(f"tiercache bench hf needs torch and transformers: {exc}") from exc
    if not torch.cuda.is_available():
        raise TierUnavailableError("tiercache bench hf needs a CUDA GPU")
    if "tiercache-files" in modes and root is None:
        raise ConfigError("the tiercache-files mode needs a root directory (--root)")
    torch.manual_seed(seed)
    cfg = LlamaConfig(**(geometry or LLAMA_3_2_1B))
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    per_token = kv_bytes_per_token(cfg, 2) * batch
    bw = h2d_gbps(torch)
    log(f"h2d {bw:.1f} GB/s; KV {per_token} bytes/token")
    runs, reference = [], {}
    files_context = files_context or min(contexts)
    rings = (ring_layers,) if isinstance(ring_layers, int) else tuple(ring_layers)
    tails = (tails,) if isinstance(tails, str) else tuple(tails)
    variants = [(r, t) for r in rings for t in tails]  # TieredCache's (ring_layers, tails)
    for ctx, entries in _plan(contexts, modes, variants, files_context).items():
        g = torch.Generator().manual_seed(seed + ctx)
        ids = torch.randint(1, cfg.vocab_size, (batch, ctx - new_tokens), generator=g).cuda()
        passes: dict[tuple, list] = {e: [] for e in entries}
        cold: dict[tuple, dict] = {}
        # a cold pass (the first plain run is every run's reference), then passes in rotated
        # orders, so that a host whose speed drifts during the run weighs on every mode alike
        for p in range(-1, repeat):
            order = entries if p < 0 else entries[p % len(entries):] + entries[:p % len(entries)]
            for mode, variant in order:
                n_new = files_new_tokens if mode == "tiercache-files" else new_tokens
                rec, r = _one_run(torch, model, cfg, mode, ctx, ids, n_new, per_token, root, host_fraction,
                                  tokens_per_block, variant, DynamicCache, TieredCache)
                if mode == "plain" and ctx not in reference:
                    reference[ctx] = r
                rec.update(compare_to_reference(torch, reference[ctx], r, ids.shape[1]))
                if p < 0:
                    cold[mode, variant] = rec
                else:
                    passes[mode, variant].append(rec)
        for e in entries:
            rec = _summarize(e, passes, cold, ctx, bw, per_token)
            runs.append(rec)
            log(_run_line(rec, ctx))
    if root is not None:
        shutil.rmtree(Path(root) / "hf-fio", ignore_errors=True)
    return {"h2d_gbps": bw, "kv_bytes_per_token": per_token, "batch": batch, "tokens_per_block": tokens_per_block,
            "ring_layers": list(rings), "tails": list(tails), "gpu": torch.cuda.get_device_name(), "runs": runs,
            # the peer's own divergence is reported, not judged: ok is about tiercache's modes
            "ok": all(r["first_divergence"] is None or r["max_logit_diff"] <= LOGIT_TOLERANCE for r in runs
                      if r["mode"] != "offloaded")}


def _plan(contexts, modes, variants: list, files_context: int) -> dict[int, list[tuple[str, tuple | None]]]:
    """Per context length, the runs of a pass, in order: ``(mode, variant)``; ``plain`` first
    (every run's reference), each tiercache mode once per ``(ring_layers, tails)`` variant, the
    files mode (and a plain run as its reference) at ``files_context``."""
    plan = [(m, c, r) for c in contexts for m in dict.fromkeys(("plain", *modes)) if m != "tiercache-files"
            for r in (variants if m.startswith("tiercache") else (None,))]
    if "tiercache-files" in modes:
        if files_context not in contexts:
            plan.append(("plain", files_context, None))
        plan.extend(("tiercache-files", files_context, r) for r in variants)
    groups: dict[int, list] = {}
    for mode, ctx, variant in plan:
        groups.setdefault(ctx, []).append((mode, variant))
    return groups


def _summarize(e: tuple, passes: dict[tuple, list], cold: dict[tuple, dict], ctx: int, bw: float,
               per_token: int) -> dict:
    """Run ``e``'s record: its median pass, its cold pass's figures, its share of the PCIe
    bound (``bw`` GB/s over ``per_token`` bytes of KV per token at the run's mean length),
    and its tokens/s against plain and plain-h2d paired pass by pass."""
    rec = _median_pass(passes[e])
    rec["cold_decode_tok_s"] = cold[e]["decode_tok_s"]
    rec["cold_identical"] = cold[e]["identical"]
    mean_len = ctx - rec["new_tokens"] / 2
    rec["pcie_bound_tok_s"] = bw * 1e9 / (per_token * mean_len)
    rec["share_of_bound"] = rec["decode_tok_s"] / rec["pcie_bound_tok_s"]
    # paired ratios: each pass runs every mode back to back, so a host whose speed drifts
    # between passes weighs on both sides of a ratio alike
    for name, base in (("vs_plain", ("plain", None)), ("vs_ceiling", ("plain-h2d", None))):
        if base in passes and e != base:
            ratios = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(passes[e], passes[base])
                      if b["decode_tok_s"]]
            rec[name] = statistics.median(ratios) if ratios else 0.0
    return rec


def _run_line(rec: dict, ctx: int) -> str:
    """One run's log line."""
    return (f"{_label(rec):16s} ctx {ctx:6d}: ttft {rec['ttft_s']:.2f} s, decode {rec['decode_tok_s']:.1f} tok/s "
            f"(passes {', '.join(f'{x:.1f}' for x in rec['decode_tok_s_passes'])}; cold run "
            f"{rec['cold_decode_tok_s']:.1f}; {rec['share_of_bound']:.2f} of PCIe bound), peak VRAM "
            f"{rec['peak_vram_bytes'] / 2**20:.0f} MiB (decode {rec['decode_peak_vram_bytes'] / 2**20:.0f}), "
            f"cache host {rec.get('cache_host_ms_per_step', 0):.1f} ms/step, GPU wait "
            f"{rec['gpu_wait_ms_per_step']:.1f} ms/step, forward {rec['forward_host_ms_per_step']:.1f} of "
            f"{rec['step_ms']:.1f} ms/step, identical {rec['identical']} (max logit diff {rec['max_logit_diff']:.3g})")


def _median_pass(recs: list[dict]) -> dict:
    """The pass with the median decode tokens/s, with every pass's tokens/s and the worst
    token comparison over the passes."""
    by_speed = sorted(recs, key=lambda r: r["decode_tok_s"])
    rec = dict(by_speed[(len(by_speed) - 1) // 2])
    rec["decode_tok_s_passes"] = [r["decode_tok_s"] for r in recs]
    firsts = [r["first_divergence"] for r in recs if r["first_divergence"] is not None]
    rec["identical"] = all(r["identical"] for r in recs)
    rec["first_divergence"] = min(firsts) if firsts else None
    rec["max_logit_diff"] = max(r["max_logit_diff"] for r in recs)
    return rec


def _label(rec: dict) -> str:
    """A run's mode, with its ring size (and tails, where not in host memory) for tiercache's
    modes."""
    tails = f" tails={rec['tails']}" if rec.get("tails", "host") != "host" else ""
    return rec["mode"] + (f" R={rec['ring_layers']}" if rec.get("ring_layers") else "") + tails


def _one_run(torch, model, cfg, mode: str, ctx: int, ids, n_new: int, per_token: int, root, host_fraction: float,
             tokens_per_block: int, variant: tuple | None, DynamicCache, TieredCache) -> tuple[dict, dict]:
    """One generate of ``mode``: its record (times, VRAM, pinned bytes, the cache's counters)
    and the raw run (tokens, logits). ``variant``: tiercache's ``(ring_layers, tails)``."""
    ring_layers, tails = variant or (None, None)
    kw, cache, ceiling = {}, None, None
    if mode == "plain":
        kw["past_key_values"] = DynamicCache(config=cfg)
    elif mode == "plain-h2d":
        kw["past_key_values"] = DynamicCache(config=cfg)
        ceiling = StreamingCeiling(torch, model, kw["past_key_values"], per_token // cfg.num_hidden_layers, ctx)
    elif mode == "offloaded":
        kw["cache_implementation"] = "offloaded"
    else:
        host = None if mode == "tiercache-host" else int(per_token * ctx * host_fraction)
        sub = None if mode == "tiercache-host" else Path(root) / "hf-bench"
        cache = TieredCache(model, max_cache_len=ctx, tokens_per_block=tokens_per_block, host_bytes=host, root=sub,
                            ring_layers=ring_layers, tails=tails)
        kw["past_key_values"] = cache
    gc.collect()  # what earlier runs left to the cycle collector must not be freed during this one's peaks
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()
    try:
        r = _timed_generate(torch, model, ids, n_new, cache=cache, **kw)
        rec = {"mode": mode, "context": ctx, "new_tokens": n_new, "ttft_s": r["ttft_s"],
               "forward_host_ms_per_step": r["forward_host_ms_per_step"], "step_ms": r["step_ms"],
               "decode_tok_s": r["decode_tok_s"], "peak_vram_bytes": max(r["prefill_peak"], r["decode_peak"]) - base,
               "decode_peak_vram_bytes": r["decode_peak"] - base, "pinned_bytes": _pinned_bytes(torch),
               "gpu_wait_ms_per_step": r["gpu_wait_ms_per_step"]}
        if cache is not None:
            rec["ring_layers"] = ring_layers
            rec["cache_host_ms_per_step"] = r.get("cache_host_ms_per_step", 0.0)
            st = cache.stats()
            rec["tails"] = st["tail_memory"]
            rec["pinned_bytes"] += st["tiers"]["host"]["bytes_capacity"] + (
                st["tail_bytes"] if st["tail_memory"] == "host" else 0)
            rec["vram_ring_bytes"] = st["vram_bytes"]
            rec["prepared"] = st["prepared"]
            rec["counters"] = {k: v for k, v in st["counters"].items() if k.startswith(("bytes_", "onboard_"))}
            if mode == "tiercache-files":
                steps_s = n_new / max(r["decode_tok_s"], 1e-9) if r["decode_tok_s"] else 0
                rec["file_read_gbps"] = st["counters"].get("bytes_file_to_host", 0) / 1e9 / max(
                    r["ttft_s"] + steps_s, 1e-9)
                rec["kv_over_host"] = per_token * ctx / st["tiers"]["host"]["bytes_capacity"]
                rec["disk"] = _disk_baseline(Path(root) / "hf-fio", st["block_bytes"] // 2)
    finally:
        if cache is not None:
            cache.close()
        if ceiling is not None:
            ceiling.close()
    return rec, r


def _disk_baseline(directory: Path, file_bytes: int) -> dict | None:
    """fio random reads of ``file_bytes`` blocks on ``directory`` (None without fio)."""
    from tiercache.bench.fiobase import fio_binary, run_fio
    from tiercache.bench.fiospec import FioJob

    if fio_binary() is None:
        return None
    job = FioJob(name="hfdisk", rw="randread", iodepth=16, direct=True)
    rec = run_fio(job, file_bytes, max(64, (1 << 30) // file_bytes), directory, "read")
    return {"method": rec["method"], "read_gbps": rec["bw_bytes"] / 1e9}


def format_hf_report(rep: dict) -> str:
    """A text table of :func:`run_hf_bench`'s report."""
    lines = [f"{rep['gpu']}: contiguous host->device {rep['h2d_gbps']:.1f} GB/s; KV {rep['kv_bytes_per_token']} "
             f"bytes/token; batch {rep['batch']}",
             f"{'mode':32s} {'context':>7s} {'TTFT s':>7s} {'tok/s':>7s} {'PCIe bound':>10s} {'share':>6s} "
             f"{'VRAM MiB':>9s} {'decode':>7s} {'pinned MiB':>10s} identical (first differing step, max logit diff "
             "up to it)"]
    for r in rep["runs"]:
        lines.append(f"{_label(r):32s} {r['context']:7d} {r['ttft_s']:7.2f} {r['decode_tok_s']:7.1f} "
                     f"{r['pcie_bound_tok_s']:10.1f} {r['share_of_bound']:6.2f} {r['peak_vram_bytes'] / 2**20:9.0f} "
                     f"{r['decode_peak_vram_bytes'] / 2**20:7.0f} {r['pinned_bytes'] / 2**20:10.0f} {r['identical']} "
                     f"({r['first_divergence']}, {r['max_logit_diff']:.3g})"
                     + (f"; passes {'/'.join(f'{x:.1f}' for x in r['decode_tok_s_passes'])}"
                        if "decode_tok_s_passes" in r else "")
                     + (f"; cold run {r['cold_decode_tok_s']:.1f} tok/s" if "cold_decode_tok_s" in r else "")
                     + "".join(f"; {k.replace('_', ' ')} {r[k]:.2f}" for k in ("vs_plain", "vs_ceiling") if k in r)
                     + f"; GPU wait {r['gpu_wait_ms_per_step']:.1f} ms/step"
                     + (f", forward {r['forward_host_ms_per_step']:.1f} of {r['step_ms']:.1f} ms/step"
                        if "step_ms" in r else "")
                     + (f", cache host {r['cache_host_ms_per_step']:.1f} ms/step" if "cache_host_ms_per_step" in r
                        else ""))
        if "file_read_gbps" in r:
            disk = r.get("disk")
            lines.append(
                f"  files: KV {r['kv_over_host']:.1f}x the host tier; read {r['file_read_gbps']:.2f} GB/s "
                "from files"
                + (
                    f" vs fio {disk['read_gbps']:.2f} GB/s ({r['file_read_gbps'] / disk['read_gbps']:.2f})"
                    if disk
                    else ""
                )
            )
    lines.append("tiercache's tokens: " + ("identical to the plain cache, or logits within "
                                           f"{LOGIT_TOLERANCE} up to the first differing token" if rep["ok"]
                                           else "DIFFER beyond the tolerance")
                 + " (the offloaded peer's rows say its own)")
    return "\n".join(lines)
