"""Moved to kvfsm.dataplane.pools.device_pool; this path stays because earlier docs showed it."""

from .pools.device_pool import DeviceKVPool, MHADeviceKVPool, MLADeviceKVPool, resolve_device

__all__ = ["DeviceKVPool", "MHADeviceKVPool", "MLADeviceKVPool", "resolve_device"]
