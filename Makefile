# Every target does its own set-up: a virtual environment, the Python packages, the Kafka jars.
# A second run reuses what the first installed (the venv is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# promtool checks and unit-tests the alert rules (deploy/prometheus); built once from the Go module proxy.
PROMTOOL := $(HOME)/.cache/stepstream/bin/promtool
PROMETHEUS_VERSION := v0.316.0

.PHONY: install jars demo test lint broker-stop clean

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

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

broker-stop: $(STAMP)
	$(VENV)/bin/stepstream broker stop

clean:
	-$(VENV)/bin/stepstream broker stop
	rm -rf $(VENV) .stepstream
