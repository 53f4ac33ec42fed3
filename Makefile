# Swarmgate: the two commands a newcomer needs are `make run` and `make test`.
CARGO ?= cargo
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: models services build build-cuda check-cuda run test sdk-test fuzz fmt lint bench clean

models:
	@scripts/fetch-models.sh

services:
	@scripts/services.sh

build:
	$(CARGO) build --release --bin swarmgate

# The `cuda` feature, built without a GPU from NVIDIA's CUDA 13.0 wheels on PyPI (fetched once
# into CUDA_TOOLKIT, about 1 GB): target/cuda/release/swarmgate, stripped, with compressed kernels
# for CUDA_COMPUTE_CAP (90: H100/H200). A build of its own, so the CPU build stays as it is; it
# travels to GPU machines, so its CPU code targets CUDA_TARGET_CPU (AVX2), not this machine.
CUDA_TOOLKIT ?= $(HOME)/.cache/cuda13
CUDA_TARGET ?= target/cuda
CUDA_TARGET_CPU ?= x86-64-v3
CUDA_ENV = $(CARGO) fetch -q && eval "$$(scripts/cuda-toolkit.sh $(CUDA_TOOLKIT))" \
	&& export RUSTFLAGS="-C target-cpu=$(CUDA_TARGET_CPU)"

build-cuda:
	$(CUDA_ENV) && $(CARGO) build --release -p cli --features cuda --target-dir $(CUDA_TARGET)
	strip $(CUDA_TARGET)/release/swarmgate
	@ls -l $(CUDA_TARGET)/release/swarmgate

# Type-checks the CUDA code (every crate, its tests too); CI runs it when the toolkit is cached.
check-cuda:
	$(CUDA_ENV) && $(CARGO) check --workspace --all-targets --features cli/cuda --target-dir $(CUDA_TARGET)

run: models build
	./target/release/swarmgate serve --host $(HOST) --port $(PORT)

test: models services
	$(CARGO) test --workspace --all-targets
	@CARGO="$(CARGO)" scripts/sdk-tests.sh
	@CARGO="$(CARGO)" scripts/reliability.sh

# The real-client suite alone: the official OpenAI Python SDK against `swarmgate serve`.
sdk-test: models
	@CARGO="$(CARGO)" scripts/sdk-tests.sh

# The fuzz targets on stable for a bounded time: corpus, then 30 s of mutations per target.
fuzz: models
	SWARMGATE_FUZZ_SECS=30 $(CARGO) test -p swarmgate-fuzz

fmt:
	$(CARGO) fmt --all

# No import cycle among a crate's modules may hold more than 3 files.
MAX_MODULE_CYCLE ?= 3

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	python3 scripts/module-cycles.py --max $(MAX_MODULE_CYCLE)

bench: models build
	./target/release/swarmgate bench --concurrency 1,4,16,32 --max-tokens 128

clean:
	$(CARGO) clean
