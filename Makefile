# Every target does its own set-up: a virtual environment, the Python packages, the Kafka jars.
# A second run reuses what the first installed (the venv is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# promtool checks and unit-tests the alert rules (deploy/prometheus); built once from the Go module proxy.
PROMTOOL := $(HOME)/.cache/stepstream/bin/promtool
PROMETHEUS_VERSION := v0.316.0

.PHONY: install jars demo test soak lint broker-stop clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "stepstream needs Python 3.11+")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

jars: $(STAMP)
	@$(PY) -c 'from eventstore.broker import fetch_jars; print("Kafka jars:", fetch_jars())'

demo: jars
	$(VENV)/bin/stepstream demo

$(PROMTOOL):
	GOBIN=$(dir $(PROMTOOL)) GOFLAGS=-mod=mod go install github.com/prometheus/prometheus/cmd/promtool@$(PROMETHEUS_VERSION)

test: jars $(PROMTOOL)
	$(PY) -m pytest

# The soak runs kept out of `make test`'s 15 minutes: two of every service on three brokers through a coordinator's
# SIGKILL with more tasks; tasks waiting out services and a broker SIGKILLed every few seconds; and the loop of
# coordinator kills (STEPSTREAM_KILL_RUNS runs), whose figures end in one JSON line.
soak: jars
	STEPSTREAM_SOAK_TASKS=$${STEPSTREAM_SOAK_TASKS:-40} $(PY) -m pytest -n 0 tests/test_many_instances.py \
		tests/test_waiting_out_kills.py
	$(PY) -m benchmarks.broker_kill_loop --runs $${STEPSTREAM_KILL_RUNS:-5}

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

broker-stop: $(STAMP)
	$(VENV)/bin/stepstream broker stop

clean:
	-$(VENV)/bin/stepstream broker stop
	rm -rf $(VENV) .stepstream
