"""tiercache.integrations.transformers.TieredCache: greedy generation with random-weight
Llama, Qwen2 and Mistral-style (GQA) models gives exactly DynamicCache's tokens, with the KV in
the host tier and with most of it in files (host tier smaller than half the KV); unsupported
models and operations are clear errors. On the CPU with host tensors (CI, where transformers
is installed) and on a GPU (bf16, CUDA tensors)."""

from __future__ import annotations

import os
import random

import pytest
from conftest import files, require_integration  # noqa: E402

torch = require_integration("torch")
transformers = require_integration("transformers")

from transformers import DynamicCache  # noqa: E402

from tiercache import ConfigError  # noqa: E402
from tiercache.integrations.transformers import TieredCache, UnsupportedCacheOperation, kv_bytes_per_token  # noqa: E402

GEOMETRY = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)


def _model(kind: str, device: str, dtype):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    extra = {"sliding_window": None} if kind == "mistral" else {}
    if kind == "qwen2":
        extra = {"use_sliding_window": False, "layer_types": ["full_attention"] * GEOMETRY["num_hidden_layers"]}
    cfg = cls[0](**GEOMETRY, **extra)
    return cls[1](cfg).to(device=device, dtype=dtype).eval()


def _generate(model, ids, cache, new_tokens):
    mask = torch.ones_like(ids)
    with torch.no_grad():
        # min_new_tokens: a random model's greedy tokens may hit its EOS early, and then fewer tokens
        # than asked pass through the cache (the token counts below would not hold)
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, past_key_values=cache, pad_token_id=0)


def _check_modes(kind, device, dtype, tmp_path, batch, prompt, new_tokens, tpb):
    seed = int(os.environ.get("TIERCACHE_TEST_SEED") or random.randrange(1 << 30))  # a failure's seed, to replay it
    torch.manual_seed(seed)
    model = _model(kind, device, dtype)
    ids = torch.randint(1, GEOMETRY["vocab_size"], (batch, prompt), device=device)
    want = _generate(model, ids, DynamicCache(config=model.config), new_tokens)
    total = prompt + new_tokens
    layers = GEOMETRY["num_hidden_layers"]
    # given the config, onboards go at the next update; given the model, from its o_proj hooks
    # tails in pinned host memory (the default; on a GPU the append kernel reaches them across
    # the bus) or in VRAM (a GPU's only: host tensors keep the tails with the ring either way)
    variants = [(model.config, 2, "host"), (model, 2, "host"), (model, 3, "host")]
    for source, ring, tails in variants + ([(model, 2, "device")] if device == "cuda" else []):
        with TieredCache(source, max_cache_len=total, tokens_per_block=tpb, ring_layers=ring, tails=tails) as host:
            got = _generate(model, ids, host, new_tokens)
            assert torch.equal(got, want), (seed, "host", type(source).__name__, ring, tails)
            st = host.stats()
            assert st["tokens"] == [total - 1] * layers  # the last token is never fed back
            assert "file" not in st["tiers"] and st["counters"]["offloaded_blocks"] > 0
            assert st["attention_hooks"] == (layers if source is model else 0)
            assert st["tail_memory"] == ("host" if device == "cuda" and tails == "host" else "device")
    kv = kv_bytes_per_token(model.config, torch.finfo(dtype).bits // 8) * batch * total
    host_bytes = kv * 2 // 5                           # the KV is 2.5x the host tier: most blocks in files
    with TieredCache(model, max_cache_len=total, tokens_per_block=tpb, host_bytes=host_bytes,
                     root=tmp_path / kind) as spilled:
        got = _generate(model, ids, spilled, new_tokens)
        assert torch.equal(got, want), (seed, "files")
        cnt = spilled.stats()["counters"]
        assert cnt["onboard_hits_file"] > cnt.get("onboard_hits_host", 0) and cnt["bytes_file_to_host"] > kv
    assert not files(tmp_path / kind, "block_*")  # the scratch files are gone after close


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_tokens_match_dynamic_cache_cpu(tmp_path, kind):
    _check_modes(kind, "cpu", torch.float32, tmp_path, batch=2, prompt=45, new_tokens=24, tpb=8)


@pytest.fixture
def deterministic_kernels():
    """PyTorch's deterministic kernels for one test. Without them, on an H200 in bf16, two
    DynamicCache generations of the same random model differ now and then where two logits tie
    (0.6758 and 0.6758 at one step of one seed in four), and a cache that holds exactly the
    same K/V is judged against a reference that is itself not reproducible. cuBLAS's workspace
    setting, which deterministic mode requires, is set in conftest.py before any CUDA work."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_tokens_match_dynamic_cache_gpu(tmp_path, kind, deterministic_kernels):
    _check_modes(kind, "cuda", torch.bfloat16, tmp_path, batch=3, prompt=300, new_tokens=40, tpb=32)


def test_model_hooks_queue_each_onboard_behind_its_attention_and_go_at_close():
    """Given the model, every onboard after the first step's is queued from the o_proj hook
    of the layer whose buffer it fills (none waits for the next update), and close() removes
    the hooks; a second cache on the same model hooks it afresh."""
    torch.manual_seed(2)
    model = _model("llama", "cpu", torch.float32)
    ids = torch.randint(1, 300, (1, 37))
    want = _generate(model, ids, DynamicCache(config=model.config), 12)
    projs = [m.o_proj for m in model.modules() if hasattr(m, "o_proj")]
    for ring in (2, 4):
        cache = TieredCache(model, max_cache_len=64, tokens_per_block=8, ring_layers=ring)
        assert all(len(p._forward_pre_hooks) == 1 for p in projs)
        sources, inner = [], cache._launch_after

        def launch(stream, inner=inner):
            sources.append(cache._after[1] if cache._hooked else None)
            inner(stream)

        def done(index, outer=cache._attention_done):
            cache._hooked = True
            try:
                outer(index)
            finally:
                cache._hooked = False

        cache._hooked = False
        cache._launch_after, cache._attention_done = launch, done
        assert torch.equal(_generate(model, ids, cache, 12), want)
        layers = GEOMETRY["num_hidden_layers"]
        assert len(sources) == 12 * layers and None not in sources  # one per update, each from its layer's hook
        assert sources[:layers] == list(range(layers))
        cache.close()
        assert all(not p._forward_pre_hooks for p in projs)
    with TieredCache(model, max_cache_len=64, tokens_per_block=8) as again:
        assert again.attention_hooks == layers
        del again
    assert all(not p._forward_pre_hooks for p in projs)


def test_unsupported_models_and_operations_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="full-attention layers only.*sliding_attention"):
        TieredCache(transformers.MistralConfig(**GEOMETRY, sliding_window=64), max_cache_len=64)
    cfg = transformers.LlamaConfig(**GEOMETRY)
    for kw, bad in ((dict(max_cache_len=0), "max_cache_len = 0"), (dict(max_cache_len=8, ring_layers=1), "ring_layers"),
                    (dict(max_cache_len=8, tokens_per_block=0), "tokens_per_block"),
                    (dict(max_cache_len=8, host_bytes=-1), "host_bytes")):
        with pytest.raises(ConfigError, match=bad):
            TieredCache(cfg, **kw)
    torch.manual_seed(0)
    model = _model("llama", "cpu", torch.float32)
    ids = torch.randint(1, 300, (1, 20))
    with TieredCache(model.config, max_cache_len=24, tokens_per_block=8, host_bytes=4096) as small:
        with pytest.raises(ConfigError, match="host_bytes = 4096 holds .* root="):
            _generate(model, ids, small, 2)
    with TieredCache(model.config, max_cache_len=24, tokens_per_block=8) as c:
        with pytest.raises(ConfigError, match="exceed max_cache_len = 24"):
            _generate(model, ids, c, 8)
        with pytest.raises(UnsupportedCacheOperation, match="beam search"):
            c.reorder_cache(torch.tensor([0]))
        with pytest.raises(UnsupportedCacheOperation, match="cropping"):
            c.crop(-1)


@pytest.mark.parametrize("device,tails", [("cpu", "host"), pytest.param("cuda", "host", marks=pytest.mark.gpu),
                                          pytest.param("cuda", "device", marks=pytest.mark.gpu)])
def test_updates_of_any_size_return_every_token_so_far(device, tails):
    """update() driven as a forward pass drives it, with steps of random sizes: prefill
    chunks that start and end inside blocks, single-token steps that complete blocks,
    multi-token steps after them, new tokens strided as projections hand them over and, at
    times, with a strided head_dim (the tensor-copy path). Each layer's returned keys and
    values equal the concatenation of everything it was given, bit for bit; the VRAM held is
    the ring, plus the tails when they live there."""
    seed = random.randrange(1 << 30)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    layers, B, H, D, tpb, cap = 3, 2, 2, 16, 8, 96
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = transformers.LlamaConfig(**{**GEOMETRY, "num_hidden_layers": layers, "num_key_value_heads": H,
                                      "head_dim": D})
    want = [[] for _ in range(layers)]
    total, steps = 0, []
    while True:
        q = rng.randint(1, 20) if not steps or rng.random() < 0.25 else 1
        if total + q > cap:
            break
        steps.append(q)
        total += q
    with TieredCache(cfg, max_cache_len=cap, tokens_per_block=tpb, tails=tails) as c:
        for q in steps:
            for layer in range(layers):
                kv = []
                for _ in range(2):  # [B, q, H, D] transposed, or a strided head_dim now and then
                    x = torch.randn(B, q, H, 2 * D, generator=gen).to(dtype)
                    x = x[..., ::2] if rng.random() < 0.1 else x[..., :D]
                    kv.append(x.to(device).transpose(1, 2))
                want[layer].append(kv)
                k, v = c.update(kv[0], kv[1], layer)
                assert torch.equal(k, torch.cat([w[0] for w in want[layer]], 2)), (seed, steps, layer)
                assert torch.equal(v, torch.cat([w[1] for w in want[layer]], 2)), (seed, steps, layer)
        st = c.stats()
        assert st["tail_memory"] == ("host" if device == "cuda" and tails == "host" else "device")
        assert st["counters"]["offloaded_blocks"] == layers * (total // tpb)  # host blocks: every head
        ring = 2 * 2 * B * H * cap * D * torch.finfo(dtype).bits // 8
        assert st["tail_bytes"] == 2 * layers * B * H * tpb * D * torch.finfo(dtype).bits // 8
        assert c.vram_bytes == ring + (st["tail_bytes"] if st["tail_memory"] == "device" else 0)


@pytest.mark.parametrize("host_share", [0.4, 1.0])
def test_reset_starts_a_new_sequence(tmp_path, host_share):
    """Files beyond a small host tier, or a host tier that holds the KV (prepared onboards,
    whose pins reset releases)."""
    torch.manual_seed(1)
    model = _model("llama", "cpu", torch.float32)
    a, b = torch.randint(1, 300, (1, 30)), torch.randint(1, 300, (1, 17))
    host_bytes = int(kv_bytes_per_token(model.config, 4) * 64 * host_share)
    with TieredCache(model.config, max_cache_len=64, tokens_per_block=8, host_bytes=host_bytes,
                     root=tmp_path / "r") as c:
        _generate(model, a, c, 5)
        prepared = c.stats()["prepared"]
        assert prepared == (host_share == 1.0)
        assert bool(c.tiers.placement.pins) == prepared
        assert (c.stats()["counters"].get("prepared_onboard_launches", 0) > 0) == prepared
        c.reset()
        assert c.get_seq_length() == 0 and not c.tiers.placement.pins
        got = _generate(model, b, c, 9)
    assert torch.equal(got, _generate(model, b, DynamicCache(config=model.config), 9))


def test_bench_compares_tokens_and_logits_up_to_the_first_difference():
    from tiercache.bench.benchhf import compare_to_reference

    logits = [torch.randn(1, 8) for _ in range(4)]
    for x in logits:
        x[0, 0] = -float("inf")                   # a token min_new_tokens forbids: -inf in both runs
    ref = {"tokens": torch.tensor([[5, 6, 1, 2, 3, 4]]), "logits": logits}
    same = {"tokens": ref["tokens"].clone(), "logits": [x + 0.01 for x in logits]}
    got = compare_to_reference(torch, ref, same, prompt=2)
    assert got["identical"] and got["first_divergence"] is None and abs(got["max_logit_diff"] - 0.01) < 1e-5
    late = {
        "tokens": torch.tensor([[5, 6, 1, 2, 7, 7]]),
        "logits": [logits[0], logits[1], logits[2] + 0.25, logits[3] + 9],
    }
    got = compare_to_reference(torch, ref, late, prompt=2)
    assert not got["identical"] and got["first_divergence"] == 2 and abs(got["max_logit_diff"] - 0.25) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU error path")
def test_bench_hf_job_needs_a_gpu(tmp_path):
    from typer.testing import CliRunner

    from tiercache.cli import app

    res = CliRunner().invoke(app, ["bench", "hf", "--root", str(tmp_path)])
    assert res.exit_code != 0 and "needs a CUDA GPU" in res.output


def test_a_prompt_shorter_than_a_block_cpu(tmp_path):
    """Prefill and every decode step within one block, then across blocks, through the tail."""
    _check_modes("llama", "cpu", torch.float32, tmp_path, batch=1, prompt=5, new_tokens=20, tpb=8)


@pytest.mark.gpu
def test_bench_hf_sweeps_ring_sizes_on_a_tiny_model(tmp_path):
    """run_hf_bench end to end on a small model: one run per ring size, the forward's host
    time inside the step, tokens checked against the plain cache."""
    from tiercache.bench.benchhf import LOGIT_TOLERANCE, run_hf_bench

    tiny = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
    rep = run_hf_bench(contexts=(300,), new_tokens=6, modes=("plain-h2d", "tiercache-host"), tokens_per_block=64,
                       ring_layers=(2, 3), tails=("host", "device"), geometry=tiny, root=tmp_path)
    assert rep["ok"] and rep["ring_layers"] == [2, 3] and rep["tails"] == ["host", "device"]
    runs = {(r["mode"], r.get("ring_layers"), r.get("tails")): r for r in rep["runs"]}
    tc = [("tiercache-host", ring, tails) for ring in (2, 3) for tails in ("host", "device")]
    assert set(runs) == {("plain", None, None), ("plain-h2d", None, None), *tc}
    for r in runs.values():
        assert 0 < r["forward_host_ms_per_step"] <= r["step_ms"]
        assert r["identical"] or r["max_logit_diff"] <= LOGIT_TOLERANCE
    host2, dev2, host3 = runs[tc[0]], runs[tc[1]], runs[tc[2]]
    assert host2["vram_ring_bytes"] < host3["vram_ring_bytes"]
    # tails in host memory: 4 layers x K and V x 2 heads x 64 tokens x 32 x bf16 less VRAM
    assert dev2["vram_ring_bytes"] - host2["vram_ring_bytes"] == 4 * 2 * 2 * 64 * 32 * 2
    # the ceiling copies bytes beside the plain cache and never touches it; ratios are paired per pass
    assert runs["plain-h2d", None, None]["identical"] and "vs_ceiling" not in runs["plain-h2d", None, None]
    assert 0 < runs["plain-h2d", None, None]["vs_plain"]
    for key in tc:
        assert 0 < runs[key]["vs_plain"] and 0 < runs[key]["vs_ceiling"]


@pytest.mark.gpu
def test_streaming_ceiling_copies_every_layer_bytes_and_unhooks():
    """The bench's plain-h2d ceiling: the plain cache's tokens, each layer's KV bytes at the
    current length landing in the scratch ring, and no hook left after close()."""
    import numpy as np

    from tiercache.bench.benchhf import StreamingCeiling

    torch.manual_seed(3)
    model = _model("llama", "cuda", torch.bfloat16)
    ids = torch.randint(1, 300, (1, 40), device="cuda")
    want = _generate(model, ids, DynamicCache(config=model.config), 6)
    cache = DynamicCache(config=model.config)
    per = kv_bytes_per_token(model.config, 2) // GEOMETRY["num_hidden_layers"]
    ceiling = StreamingCeiling(torch, model, cache, per, 64)
    ceiling._host[:] = np.random.default_rng(5).integers(0, 256, ceiling._host.size, dtype=np.uint8)
    assert all(len(layer._forward_pre_hooks) == 1 and len(layer.self_attn.o_proj._forward_pre_hooks) == 1
               for layer in model.model.layers)
    assert torch.equal(_generate(model, ids, cache, 6), want)
    ceiling.close()
    n = per * cache.get_seq_length(0)  # the last forward's copies: the whole length
    for buf in ceiling._scratch:  # the last two layers' copies went into either buffer
        assert torch.equal(buf[:n].cpu(), torch.from_numpy(ceiling._host[:n].copy()))
    assert all(not layer._forward_pre_hooks and not layer.self_attn.o_proj._forward_pre_hooks
               for layer in model.model.layers)
