"""splitserve.client: typed Python client (sync and asyncio) over the coordinator's gRPC stubs."""
