PUBLIC_READY = "splitserve coordinator ready"
INTERNAL_READY = "splitserve coordinator internal ready"
COORDINATOR_METRICS = "coordinator metrics"
"""What the coordinator's two ready lines (``<what> at <host:port>``, the internal one first)
and its metrics line (``<what> at <url>``) announce; launchers read the ports from them. Here,
not in ``main``, so that a launcher need not import the coordinator to know them."""
