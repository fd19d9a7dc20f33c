"""The subset of etcd v3's gRPC API splitserve calls: ``kv.proto`` (package ``mvccpb``) and
``rpc.proto`` (package ``etcdserverpb``), our own wire-compatible declarations, and the modules
generated from them (``make proto``). Only ``proto/etcd_client.py`` and its login,
``proto/etcd_auth.py``, import them.
"""
