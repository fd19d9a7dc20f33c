"""Starting splitserve processes: ``ChildProcess`` (one child: output, readiness, stopping) and
``splitserve up`` (``up``: a whole cluster on localhost). The ``*.sh`` scripts beside these
modules start one role each."""
