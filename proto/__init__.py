"""The wire: ``splitserve/v1/*.proto`` and the modules generated from them (``make proto``).

Import the generated modules from ``splitserve.proto.splitserve.v1``; ``codegen`` regenerates
them and rewrites their imports so that they resolve inside the ``splitserve`` namespace.
"""
