"""What differs between the vLLM releases :class:`~tiercache.integrations.vllm.TierCacheTier`
runs on (0.26 through 0.33), found by feature detection, never by version strings.

vLLM's secondary-tier interface (``vllm/v1/kv_offload/tiering``) changed between 0.26 and 0.33:

=====================================  ===============================  ============================
what                                   0.26                             0.33
=====================================  ===============================  ============================
the job a tier is handed               ``JobMetadata``, rows in         ``TransferJob``, rows in
                                       ``block_ids``                    ``chunk_ids``
what a tier reports                    ``JobResult(job_id, success)``   also ``successful_keys``,
                                                                        ``transfer_time``,
                                                                        ``transfer_bytes``
a tier's ``medium``                    a string of                      ``Medium`` (enum)
                                       ``vllm.distributed.kv_events``
                                       (``"FS"`` for files)
``SecondaryTierManager.__init__``      no ``backpressure_detector``     ``backpressure_detector``
out-of-tree tiers                      registered in                    also ``module_path`` in the
                                       ``SecondaryTierFactory`` only    tier's config
info metric (``config_info``)          none                             ``ConfigInfoMapping``
=====================================  ===============================  ============================

Everything else TierCacheTier uses (``LookupResult``, ``OffloadKey``, ``ReqContext``,
``OffloadingEvent``, ``Locality``, ``FileMapper``, the metric metadata and
``OffloadingConnectorStats``) is the same in both. Each name below is what the tier and its
tests use, whichever release is installed.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Collection, Hashable
from typing import Any

import numpy as np
from vllm.v1.kv_offload import base as _base
from vllm.v1.kv_offload.tiering import base as _tiering
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

#: the job a tier's ``submit_store`` / ``submit_load`` receive (``TransferJob`` or ``JobMetadata``)
TransferJob: type = getattr(_tiering, "TransferJob", None) or _tiering.JobMetadata
JobResult: type = _tiering.JobResult
SecondaryTierManager: type = _tiering.SecondaryTierManager

_JOB_ROWS = "chunk_ids" if "chunk_ids" in {f.name for f in dataclasses.fields(TransferJob)} else "block_ids"
_RESULT_FIELDS = frozenset(f.name for f in dataclasses.fields(JobResult))

#: whether a load can report which of its chunks succeeded (``JobResult.successful_keys``);
#: where it cannot, a load that failed for some chunks fails as a whole (vLLM recomputes them)
PARTIAL_RESULTS: bool = "successful_keys" in _RESULT_FIELDS

#: the ``medium`` of a storage tier (``Medium.STORAGE``; ``"FS"`` where there is no ``Medium``)
if hasattr(_base, "Medium"):
    STORAGE_MEDIUM: Any = _base.Medium.STORAGE
else:
    from vllm.distributed.kv_events import MEDIUM_FS as STORAGE_MEDIUM  # noqa: F401, N811 (the module's own name)

#: whether ``SecondaryTierManager.__init__`` takes a ``backpressure_detector``
TAKES_BACKPRESSURE: bool = "backpressure_detector" in inspect.signature(SecondaryTierManager.__init__).parameters
#: whether vLLM asks tiers for an info metric (``config_info_keys`` / ``config_info``)
HAS_CONFIG_INFO: bool = hasattr(SecondaryTierManager, "config_info")

#: config keys vLLM's factory passes to a tier only on releases that do not consume them itself
#: (0.26 hands ``module_path`` and ``backpressure`` through to the tier's constructor)
FACTORY_KEYS = ("module_path", "backpressure")


def job_rows(job) -> np.ndarray:
    """The primary tier's rows of ``job`` (``chunk_ids`` or ``block_ids``), int64 ``[len(keys)]``;
    also of the primary tier's load/store specs (``CPULoadStoreSpec``), which changed alike."""
    rows = getattr(job, "chunk_ids", None)
    return job.block_ids if rows is None else rows


def make_job(job_id: int, keys: Collection[bytes], rows, is_promotion: bool, req_context) -> Any:
    """A job as vLLM's tiering manager builds it (for tests and benchmarks that drive a tier)."""
    return TransferJob(job_id=job_id, keys=keys, is_promotion=is_promotion, req_context=req_context,
                       **{_JOB_ROWS: np.asarray(rows, dtype=np.int64)})


def job_result(job_id: Hashable, success: bool, successful_keys: Collection[bytes] | None = None,
               transfer_time: float | None = None, transfer_bytes: int | None = None) -> Any:
    """A ``JobResult`` with the fields this release has (the others are dropped).

    Where there is no ``successful_keys``, a job that failed for some keys is reported failed
    whole: vLLM then treats every key of it as not loaded.
    """
    extra = {"successful_keys": successful_keys, "transfer_time": transfer_time, "transfer_bytes": transfer_bytes}
    return JobResult(job_id=job_id, success=success, **{k: v for k, v in extra.items() if k in _RESULT_FIELDS})


def tier_init_args(backpressure_detector) -> dict[str, Any]:
    """Keyword arguments for ``SecondaryTierManager.__init__`` beyond the three every release takes."""
    return {"backpressure_detector": backpressure_detector} if TAKES_BACKPRESSURE else {}


def register_tier(tier_type: str, module_path: str, class_name: str) -> None:
    """Register an out-of-tree tier in vLLM's ``SecondaryTierFactory`` under ``tier_type``
    (needed where the factory has no ``module_path``; harmless where it has). A type already
    registered is left as it is."""
    try:
        SecondaryTierFactory.register_tier(tier_type, module_path, class_name)
    except ValueError:  # already registered (this module imported twice, or by the user)
        pass


def _fields(cls: type, **values: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def offloading_config(*, row_bytes: int, extra_config: dict, engine_id: str, model: str = "org/tiny-model",
                      dtype: str = "bfloat16", tokens_per_block: int = 16, layer_names: tuple[str, ...] = ("layers",),
                      events: bool = False, rank: int = 0, world_size: int = 1, blocks_per_chunk: int = 1) -> Any:
    """vLLM's normalized ``OffloadingConfig`` as its connector builds it for one KV-cache group
    whose blocks take ``row_bytes`` bytes over all workers (for tests and benchmarks that build
    a spec without an engine). Fields a release lacks are left out (0.26 has no ``group_id``,
    ``data_parallel_size`` or ``data_parallel_rank_local``)."""
    from vllm.v1.kv_offload import config as c

    return c.OffloadingConfig(
        groups=(_fields(c.OffloadingGroupConfig, tokens_per_block=tokens_per_block, layer_names=layer_names,
                        group_id=0),),
        worker_kv_bytes_per_block=row_bytes // world_size, enable_kv_cache_events=events, extra_config=extra_config,
        engine_id=engine_id, model=c.OffloadingModelConfig(name=model, dtype=dtype),
        cache=c.OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=_fields(c.OffloadingParallelConfig, rank=rank, world_size=world_size, tp_size=world_size, pp_size=1,
                         pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                         data_parallel_rank_local=None, is_parallelism_agnostic=False))
