"""The public import path of :class:`DevicePools` (``from tiercache.devicepools import
DevicePools``, as the README shows); the class lives in :mod:`tiercache.serving.devicepools`."""

from tiercache.serving import DevicePools, LayerPart

__all__ = ["DevicePools", "LayerPart"]
