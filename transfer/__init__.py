"""Moving KV blocks between workers.

``transport`` is the byte-moving contract (tagged sends to a peer address, tagged receives on
the local worker) with a UCX backend (``ucx``) and an in-process one (``inprocess``);
``plan`` cuts one request's KV into messages that land straight in the receiver's blocks;
``layer_channel`` pushes / receives one request's KV layer by layer on top of a transport.
What a worker's KV looks like, and whether two workers may exchange it, is
``splitserve.common.kv_layout`` (the membership records carry it too).
"""
