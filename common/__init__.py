"""What crosses process boundaries, torch-free: errors, sampling parameters, finish reasons,
logprobs, load figures, membership records and the KV layout they carry, prompts, tokenizer
and streaming detokenization, block hashing, request-latency metrics and environment-backed
flags. Every role imports these; the coordinator, gateway and client processes import
nothing else of the engine (a test checks that they never load torch)."""
