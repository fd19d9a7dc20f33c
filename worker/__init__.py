"""What the prefill and decode worker processes share: flags and process set-up
(``process``), registration and heartbeats to the coordinator (``registration``), and the
glue between an engine's KV cache and the transfer layer (``kv_io``)."""
