"""Configurations shipped with tiercache (installed as ``tiercache.configs``): ``default.toml``
(what ``tiercache bench`` runs), per-model cache configs, fio-style job files (``jobs/``) and
model geometries (``models/``, for ``tiercache bench vllm-serve``). Reach them through
:mod:`tiercache.resources`, which finds them in a source tree and in an installed package alike."""
