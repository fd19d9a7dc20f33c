"""Starting splitserve processes: ``ChildProcess`` (one child: output, readiness, stopping),
``splitserve up`` (``up``: a whole cluster on localhost) and ``splitserve worker``
(``dual_worker``: one process serving the prefill and decode roles on one engine). The
``*.sh`` scripts beside these modules start one role each."""
