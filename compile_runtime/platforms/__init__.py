"""What differs by device, decided in one place.

``base``: ``Platform``, the decisions a device makes for the engine (which attention
backends to try, which collective backend, how step inputs reach the device, what the
graph wrappers capture, where the KV cache's budget comes from, whether the thread count
and packed weights are ours to set); ``cpu`` and ``cuda``: the two platforms;
``select``: ``platform_for(device)``, the one place a device's type is looked at to pick (and the
meta device's platform: shapes without data).
"""
