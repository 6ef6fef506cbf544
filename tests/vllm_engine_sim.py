"""vLLM's own scheduler on the CPU, driving :class:`TierCacheConnector` as an engine does.

:class:`SimEngine` builds a real ``VllmConfig`` (a tiny Llama config on disk, no weights, no
tokenizer), vLLM's real ``Scheduler`` (its KV cache manager, prefix caching, the connector's
scheduler role loaded from ``kv_transfer_config``) and the connector's worker role over KV
caches on the CPU. :meth:`SimEngine.step` is one engine step: the scheduler's output, the
worker's hooks in the order vLLM's model runner calls them, a forward pass that writes into
each scheduled token's slot the bytes a model would compute there (a function of the token
and every token before it, as a KV entry is; other bytes where any slot it attends to is
wrong, as a model's later layers compute over a bad prefix), one sampled token per request
whose prompt is done, and the connector's output back into ``update_from_output``. So a block that vLLM hands
a request holds the right bytes exactly when every load and store on the way was right.

Synchronous by default (``async_scheduling`` off): one step is scheduled, run and accounted
before the next, as vLLM's ``EngineCore.step`` does. With ``async_scheduling=True`` it is
vLLM's ``AsyncScheduler`` in the order of ``EngineCore.step_with_batch_queue`` (a queue of two):
step N+1 is scheduled before step N's output is accounted.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tiercache.integrations.vllmconnector import TierCacheConnector

BLOCK_SIZE, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 16  # a block's row: 4 KiB, what the row reads take
VOCAB = 500


def _model_dir(base: Path) -> Path:
    """A Llama config.json of :data:`LAYERS` layers (vLLM's ModelConfig reads no weights)."""
    d = base / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * HEAD_DIM,
        "intermediate_size": 64, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": 512, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16"}))
    return d


def slot_bytes(tokens: list[int], layer: int) -> np.ndarray:
    """The K and V entry (``[2, HEADS, HEAD_DIM]`` int16) a model writes for the last of
    ``tokens`` in ``layer``: a function of that token and every one before it."""
    digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=64,
                             person=layer.to_bytes(2, "little")).digest()
    reps = -(-2 * HEADS * HEAD_DIM * 2 // len(digest))
    return np.frombuffer(digest * reps, dtype=np.int16)[:2 * HEADS * HEAD_DIM].reshape(2, HEADS, HEAD_DIM)


class SimEngine:
    """One vLLM engine on the CPU: vLLM's scheduler with the connector, its worker over
    ``num_blocks`` blocks of KV cache ([2, blocks, BLOCK_SIZE, HEADS, HEAD_DIM] float16 a
    layer; ``layout="HND"``: the same shape over memory ordered [2, blocks, HEADS, BLOCK_SIZE,
    HEAD_DIM]), on ``root``. ``extra``: more of the connector's ``kv_connector_extra_config``."""

    def __init__(self, base: Path, root: Path, num_blocks: int, async_scheduling: bool = False, layout: str = "NHD",
                 **extra) -> None:
        model = ModelConfig(model=str(_model_dir(base)), skip_tokenizer_init=True, dtype="float16",
                            max_model_len=4096)
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096,
                                enable_chunked_prefill=True, is_encoder_decoder=False,
                                async_scheduling=async_scheduling)
        cache = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True)
        ktc = KVTransferConfig(kv_connector="TierCacheConnector",
                               kv_connector_module_path="tiercache.integrations.vllmconnector", kv_role="kv_both",
                               kv_connector_extra_config={"root": str(root), "fsync": "none",
                                                          "staging_bytes": 1 << 20, "piece_blocks": 2, **extra})
        self.config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                                 kv_transfer_config=ktc, device_config=DeviceConfig(device="cpu"))
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
        kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(self.layers, spec)])
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(vllm_config=self.config, kv_cache_config=kvc, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK_SIZE)
        assert isinstance(self.scheduler.connector, TierCacheConnector)
        self.worker = TierCacheConnector(self.config, KVConnectorRole.WORKER, kvc)
        if layout == "NHD":
            self.caches = {n: torch.zeros((2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=torch.float16)
                           for n in self.layers}
        else:  # the same logical shape, heads outer to tokens in memory (as an HND backend keeps it)
            self.caches = {n: torch.zeros((2, num_blocks, HEADS, BLOCK_SIZE, HEAD_DIM), dtype=torch.float16).transpose(
                2, 3) for n in self.layers}
        self.worker.register_kv_caches(self.caches)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.steps: list[dict[str, int]] = []  # per step: tokens scheduled per request
        self.first_token_step: dict[str, int] = {}
        self.emitted: dict[str, list[int]] = {}  # the tokens vLLM gave out, per request
        self.preempted: list[str] = []  # requests vLLM preempted, in order
        self.connector_stats: list[dict] = []  # what vLLM's scheduler passed on to its stats loggers
        self._history: dict[str, list[int]] = {}  # the runner's own: prompt, then what it sampled
        self.finished: set[str] = set()
        self._queued: list = []  # (scheduler output, model runner output) not yet accounted
        self._depth = 2 if async_scheduling else 1

    def add(self, rid: str, prompt: list[int], max_tokens: int = 2) -> None:
        """Submit a request of ``prompt`` token ids that samples ``max_tokens`` tokens."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self._history[rid] = list(prompt)
        self.emitted[rid] = []
        self.scheduler.add_request(Request(rid, prompt, params, None, block_hasher=self.hasher))

    def block_ids(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def check_blocks(self, rid: str, upto: int) -> int:
        """Every slot of request ``rid``'s first ``upto`` tokens holds what the model wrote for
        that token (computed here or loaded from a file); returns the slots checked."""
        tokens = self.scheduler.requests[rid].all_token_ids
        ids = self.block_ids(rid)
        for p in range(upto):
            b, off = ids[p // BLOCK_SIZE], p % BLOCK_SIZE
            for i, name in enumerate(self.layers):
                got = self.caches[name][:, b, off].view(torch.int16).numpy()
                assert np.array_equal(got, slot_bytes(tokens[:p + 1], i)), (rid, p, b)
        return upto

    def step(self) -> dict[str, int]:
        """One engine step; returns the tokens it scheduled per request."""
        so = self.scheduler.schedule()
        self.preempted += sorted(getattr(so, "preempted_req_ids", None) or ())
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        sampled: dict[str, list[int]] = {}
        batch = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # schedule() counted the step's tokens already
            # a position's input token: the scheduler's where it has it, else (async scheduling:
            # the last sampled token is still on the device) the runner's own last sample
            tokens = list(req.all_token_ids[:start + n])
            tokens += self._history[rid][len(tokens):start + n]
            batch.append([rid, n, start, tokens, self.block_ids(rid), False])
        for i, name in enumerate(self.layers):  # the forward pass, layer by layer, as vLLM's attention calls
            if batch:
                w.wait_for_layer_load(name)
            for entry in batch:
                rid, n, start, tokens, ids, wrong = entry
                # a layer computes over what it attends to, and over the layers before it
                entry[5] = wrong = wrong or not self._attended_ok(ids, tokens, start, [i])
                for p in range(start, start + n):
                    b, off = ids[p // BLOCK_SIZE], p % BLOCK_SIZE
                    v = slot_bytes(tokens[:p + 1], i) ^ np.int16(0x5A5A * wrong)
                    self.caches[name][:, b, off] = torch.from_numpy(v.copy()).view(torch.float16)
        for rid, n, start, tokens, ids, _ in batch:
            req = self.scheduler.requests[rid]
            done = start + n >= req.num_prompt_tokens
            sampled[rid] = [self._sample(ids, start + n)] if done else []
            if done:
                del self._history[rid][start + n:]
                self._history[rid] += sampled[rid]
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        kvo = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                invalid_block_ids=w.get_block_ids_with_load_errors())
        kvo.kv_connector_worker_meta = w.build_connector_worker_meta()
        kvo.kv_connector_stats = w.get_kv_connector_stats()
        w.clear_connector_metadata()
        rids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                sampled_token_ids=[sampled[r] for r in rids], kv_connector_output=kvo)
        self._queued.append((so, out, len(self.steps)))
        self.steps.append(dict(so.num_scheduled_tokens))
        if len(self._queued) >= self._depth:
            self._account()
        return self.steps[-1]

    def _attended_ok(self, ids: list[int], tokens: list[int], upto: int, layers: list[int]) -> bool:
        """Whether every slot of positions ``[0, upto)`` in ``layers`` holds what the model
        wrote for it."""
        for p in range(upto):
            b, off = ids[p // BLOCK_SIZE], p % BLOCK_SIZE
            for i in layers:
                name = self.layers[i]
                if not np.array_equal(self.caches[name][:, b, off].view(torch.int16).numpy(),
                                      slot_bytes(tokens[:p + 1], i)):
                    return False
        return True

    def _sample(self, ids: list[int], upto: int) -> int:
        """The token a model samples after positions ``[0, upto)``: a function of the KV bytes
        it attends to (every layer's slots of those positions), so a wrong byte in any slot
        gives another token, as a wrong KV block would."""
        h = hashlib.blake2b(digest_size=8)
        for name in self.layers:
            c = self.caches[name]
            for p in range(upto):
                h.update(c[:, ids[p // BLOCK_SIZE], p % BLOCK_SIZE].view(torch.int16).numpy().tobytes())
        return 1 + int.from_bytes(h.digest(), "little") % (VOCAB - 1)

    def _account(self) -> None:
        so, out, step = self._queued.pop(0)
        for eco in self.scheduler.update_from_output(so, out).values():
            stats = getattr(eco.scheduler_stats, "kv_connector_stats", None)
            if stats:
                self.connector_stats.append(stats)
            for o in eco.outputs:
                if o.new_token_ids and not self.emitted[o.request_id]:
                    self.first_token_step[o.request_id] = step  # the step whose output vLLM gave out
                self.emitted[o.request_id] += list(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)

    def run(self, until, limit: int = 50) -> int:
        """Step until ``until()`` holds; returns the steps taken (AssertionError past ``limit``)."""
        for n in range(limit):
            if until():
                return n
            self.step()
        raise AssertionError(f"not done after {limit} steps: {self.steps[-5:]}")

    def close(self) -> None:
        while self._queued:
            self._account()
        self.worker.shutdown()
