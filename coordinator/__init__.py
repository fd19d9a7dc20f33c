PUBLIC_READY = "splitserve coordinator ready"
INTERNAL_READY = "splitserve coordinator internal ready"
"""What the coordinator's two ready lines announce (``<what> at <host:port>``, the internal
one first); launchers read the ports from them. Here, not in ``main``, so that a launcher
need not import the coordinator to know them."""
