"""splitserve.frontend: the coordinator and the OpenAI-compatible gateway in one process
(``splitserve frontend``), the gateway's streams handed to the coordinator without gRPC."""
