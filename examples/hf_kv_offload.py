"""Greedy generation with a small Hugging Face causal LM whose KV cache leaves the GPU through
tiercache between decoding steps, and comes back, with identical tokens.

The model is a LlamaForCausalLM built from a config with random weights (nothing is
downloaded). The "engine" keeps a paged KV cache in the vLLM layout (one tensor per layer,
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, scattered block ids), registered
with tiercache without copying. After every decoding step it:

1. writes the step's KV cache into its paged blocks;
2. offloads them (host blocks of 2 device blocks; every other step straight on to block files),
   then wipes both its paged blocks and the model's cache tensors;
3. onboards the blocks layer by layer, copying layer i back into the model's cache as soon as
   layer i has landed, and decodes the next token.

The tokens are compared with a plain run; the script exits 1 if any differs.

Run:  python examples/hf_kv_offload.py [--steps 24] [--root /mnt/nvme/tiercache-example]
(on a CUDA GPU; without one it runs on the CPU with a host-memory "device" tier).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tiercache import TierCache
from tiercache.enginetensors import DevicePools

BLOCK = 16  # tokens per device block
K = 2  # device blocks per host/file block


def build_model(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def kv_tensors(past):
    """``[(K, V)]`` per layer, each ``[batch, kv_heads, seq, head_dim]`` (the model's own tensors)."""
    if hasattr(past, "layers"):
        return [(layer.keys, layer.values) for layer in past.layers]
    return list(zip(past.key_cache, past.value_cache))


@torch.no_grad()
def generate(model, prompt, steps: int, hook=None) -> list[int]:
    out = model(input_ids=prompt, use_cache=True)
    past, tokens = out.past_key_values, []
    for step in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        if hook is not None:
            hook(step, past)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
    return tokens


class PagedOffload:
    """The engine side: paged KV blocks registered with tiercache, moved out and back each step."""

    def __init__(self, model, max_tokens: int, root: Path, device: str) -> None:
        cfg = model.config
        heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        self.num_blocks = 2 * math.ceil(max_tokens / BLOCK)
        dtype = next(model.parameters()).dtype
        self.paged = [torch.zeros((self.num_blocks, 2, BLOCK, heads, head_dim), dtype=dtype, device=device)
                      for _ in range(cfg.num_hidden_layers)]
        # scattered block ids, like an engine's block table
        self.table = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        pools = DevicePools.vllm(self.paged, host_ok=device == "cpu")
        self.cache = TierCache.for_engine(pools, host_slots=self.num_blocks, file_slots=4 * self.num_blocks,
                                          blocks_per_host_block=K, root=root, fsync="none")
        self.moved = 0
        self.seconds = 0.0

    def hook(self, step: int, past) -> None:
        kv = kv_tensors(past)
        seq = kv[0][0].shape[2]
        nblk = math.ceil(seq / BLOCK)
        for layer, (k, v) in enumerate(kv):  # 1. the engine writes its paged blocks
            for b in range(nblk):
                s0, n = b * BLOCK, min(BLOCK, seq - b * BLOCK)
                blk = self.table[b]
                self.paged[layer][blk, 0, :n] = k[0, :, s0:s0 + n].transpose(0, 1)
                self.paged[layer][blk, 1, :n] = v[0, :, s0:s0 + n].transpose(0, 1)
        nhost = math.ceil(nblk / K)
        ids = [[self.table[h * K + j] if h * K + j < nblk else -1 for j in range(K)] for h in range(nhost)]
        keys = [(1 << 32) | h for h in range(nhost)]
        t0 = time.perf_counter()
        # 2. out to host (and every other step on to files); the copy waits for the writes above
        self.cache.offload_slots(keys, ids, to="file" if step % 2 else "host", wait=True)
        t1 = time.perf_counter()
        for p in self.paged:
            p.zero_()
        for k, v in kv:
            k.zero_()
            v.zero_()
        # 3. back, layer by layer
        handle = self.cache.onboard_slots(keys, ids, layerwise=True)
        for layer, (k, v) in enumerate(kv):
            handle.wait_layer(layer)  # the current stream waits for this layer only
            for b in range(nblk):
                s0, n = b * BLOCK, min(BLOCK, seq - b * BLOCK)
                blk = self.table[b]
                k[0, :, s0:s0 + n] = self.paged[layer][blk, 0, :n].transpose(0, 1)
                v[0, :, s0:s0 + n] = self.paged[layer][blk, 1, :n].transpose(0, 1)
        handle.synchronize()
        self.seconds += t1 - t0 + (time.perf_counter() - t1)
        self.moved += sum(p[0].numel() * p.element_size() for p in self.paged) * nblk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=37)
    ap.add_argument("--root", type=Path, default=Path(tempfile.mkdtemp(prefix="tiercache-example-")))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(device)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(2)).to(device)
    plain = generate(model, prompt, args.steps)
    engine = PagedOffload(model, args.prompt_tokens + args.steps + 1, args.root, device)
    with engine.cache:
        tiered = generate(model, prompt, args.steps, hook=engine.hook)
        stats = engine.cache.stats()
    same = plain == tiered
    print(f"device: {device}; model: {model.config.num_hidden_layers} layers, random weights; "
          f"I/O path: {stats['io_path']['label']}")
    print(f"tokens without tiercache: {plain}")
    print(f"tokens with tiercache:    {tiered}")
    c = stats["counters"]
    print(f"moved out and back {args.steps} times: {engine.moved / 2**20:.1f} MiB of KV blocks each way; "
          f"{c.get('offloaded_blocks', 0)} host blocks offloaded, {c.get('onboarded_blocks', 0)} onboarded, "
          f"{c.get('bytes_host_to_file', 0) / 2**20:.1f} MiB written to files")
    print("identical tokens: " + ("yes" if same else "NO"))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
