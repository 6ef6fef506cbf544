"""Serving engines' own KV-cache tensors as the device tier.

- :mod:`.devicepools`: :class:`DevicePools`: the engine's tensors (vLLM, SGLang, TensorRT-LLM,
  FastDeploy, MLA layouts) described as pools;
- :mod:`.slotplan`: the engine's block ids ``[n, k]`` -> row copies (host blocks of ``k``
  device blocks, whole or first tokens, whole or per layer);
- :mod:`.layerwise`: :class:`OnboardHandle`: one CUDA event per layer of an onboard;
- :mod:`.prepared`: :class:`PreparedOnboard`: an onboard planned once (keys checked, host
  blocks pinned, copy plan built) and launched many times;
- :mod:`.engineslots`: :class:`EngineSlots`: ``offload_slots`` / ``onboard_slots`` by block id,
  the part of :class:`~tiercache.TierCache` that works on the engine's tensors.

(Rows of an engine's host KV buffer <-> block files: :class:`tiercache.RowStore`, the second
facade beside :class:`~tiercache.TierCache`.)

Depends on :mod:`tiercache.moves`, :mod:`tiercache.placement`, :mod:`tiercache.transfer`, :mod:`tiercache.files`,
:mod:`tiercache.memory`.
"""

from .devicepools import DevicePools, LayerPart
from .engineslots import EngineSlots
from .layerwise import OnboardHandle
from .prepared import PreparedOnboard

__all__ = [
    "DevicePools", "EngineSlots", "LayerPart", "OnboardHandle", "PreparedOnboard",
]
