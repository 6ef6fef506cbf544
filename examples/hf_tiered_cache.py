"""Generate with a Hugging Face model whose KV cache lives in tiercache's host tier and files.

    python examples/hf_tiered_cache.py                       # tiny random model, host tier
    python examples/hf_tiered_cache.py --root /mnt/nvme/kv   # host tier of 40% of the KV, rest in files

Copy the three lines marked "tiercache" into your own code: create a TieredCache from the
model's config and the longest sequence you will generate, pass it as past_key_values, close it.
The script checks the tokens against transformers' DynamicCache.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tiercache.integrations.transformers import TieredCache, kv_bytes_per_token


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="tokens to generate")
    ap.add_argument("--root", default=None, help="a directory for the file tier (default: host tier only)")
    args = ap.parse_args()
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    ids = torch.randint(1, config.vocab_size, (1, args.prompt), device=device)
    total = args.prompt + args.new
    host_bytes = None
    if args.root:  # a host tier of 40% of the KV: most blocks live in files
        host_bytes = kv_bytes_per_token(config, torch.finfo(dtype).bits // 8) * total * 2 // 5
    with torch.no_grad():
        want = model.generate(
            ids, max_new_tokens=args.new, do_sample=False, past_key_values=DynamicCache(config=config)
        )
        cache = TieredCache(model, max_cache_len=total, tokens_per_block=16,          # tiercache
                            host_bytes=host_bytes, root=args.root)
        out = model.generate(ids, max_new_tokens=args.new, do_sample=False, past_key_values=cache)  # tiercache
        stats = cache.stats()
        cache.close()                                                                  # tiercache
    cnt = stats["counters"]
    print(f"{stats['tokens'][0]} tokens per layer; VRAM held by the cache: {stats['vram_bytes'] / 2**20:.1f} MiB")
    print(f"host -> device {cnt.get('bytes_host_to_device', 0) / 2**20:.1f} MiB, "
          f"files -> host {cnt.get('bytes_file_to_host', 0) / 2**20:.1f} MiB")
    print("identical tokens:", "yes" if torch.equal(out, want) else "NO")


if __name__ == "__main__":
    main()
