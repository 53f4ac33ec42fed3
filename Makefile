# Swarmgate: the two commands a newcomer needs are `make run` and `make test`.
CARGO ?= cargo
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: models services build run test sdk-test fuzz fmt lint bench clean

models:
	@scripts/fetch-models.sh

services:
	@scripts/services.sh

build:
	$(CARGO) build --release --bin swarmgate

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
