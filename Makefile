# recforge: the commands README names. `make demo` and `make test` set everything up on first use.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTHON ?= python3
PYTEST_TIMEOUT ?= 900
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: help venv test lint demo up down status bench clean distclean lock sysdeps

help:
	@echo "make demo      build the venv if needed, run 'recforge demo'"
	@echo "make test      build the venv if needed, run make lint, then the test suite (unit, integration, e2e)"
	@echo "make lint      ruff (lint + import sorting) and mypy, configured in pyproject.toml"
	@echo "make up        start Airflow (http://127.0.0.1:8080) and MLflow (http://127.0.0.1:5000) locally"
	@echo "make down      stop them;  make status: show them"
	@echo "make bench     run every bench/bench_*.py (BENCH_ARGS=... passes arguments)"
	@echo "make venv      (re)install .venv from pyproject.toml with the lock as constraints"
	@echo "make lock      regenerate requirements/lock.txt from .venv"
	@echo "make sysdeps   install chromium + chromium-driver (root, Debian) for the browser tests"
	@echo "make clean     remove .recforge/ (runs, stores, logs; keeps .venv);  make distclean: also .venv"

# The venv is a file target: built when missing, reinstalled when pyproject.toml (the requirements), the lock or
# the install script change.
venv: $(STAMP)

$(STAMP): pyproject.toml requirements/lock.txt scripts/install.sh
	PYTHON=$(PYTHON) scripts/install.sh $(VENV) all
	@touch $@

# Browser tests need Debian's chromium + chromedriver; install them when missing and we may (root).
sysdeps:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
	    :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium + chromium-driver (apt)"; \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; \
	else \
	    echo "warning: chromium / chromedriver missing and not installable here (needs root + apt-get):" \
	         "browser tests will be skipped. Run 'sudo make sysdeps' to enable them." >&2; \
	fi

# Two pytest runs. tests/unit on UNIT_WORKERS pytest-xdist workers, a file's tests on one worker (its module fixtures
# are built once); then tests/integration and tests/e2e one test at a time: they start ranks, servers and services of
# their own, which need the machine's cores. PYTEST_ARGS goes to both. A run that collects nothing exits 5; that is
# fine for one of the two (PYTEST_ARGS selected tests of the other kind only), and fails when both collect nothing.
UNIT_WORKERS ?= 2
test: lint sysdeps $(STAMP)
	@timeout_arg=""; \
	if $(PY) -c 'import pytest_timeout' 2>/dev/null; then timeout_arg="--timeout=$(PYTEST_TIMEOUT)"; fi; \
	unit=0; $(PY) -m pytest -q -p no:cacheprovider $$timeout_arg -n $(UNIT_WORKERS) --dist loadfile $(PYTEST_ARGS) \
	    tests/unit || unit=$$?; \
	rest=0; $(PY) -m pytest -q -p no:cacheprovider $$timeout_arg $(PYTEST_ARGS) tests/integration tests/e2e \
	    || rest=$$?; \
	echo "make test: tests/unit exit $$unit; tests/integration + tests/e2e exit $$rest"; \
	if [ $$unit -eq 5 ] && [ $$rest -eq 5 ]; then echo "make test: pytest collected no tests: failing" >&2; exit 5; fi; \
	for rc in $$unit $$rest; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done

# The venv's own ruff and mypy (pyproject's `test` extra, pinned in the lock); settings in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check platform kernels tests bench dags plugins
	$(VENV)/bin/mypy

demo: $(STAMP)
	. scripts/env.sh && $(VENV)/bin/recforge demo

up: $(STAMP)
	scripts/services.sh up

# Returns once nothing of the platform runs (services, task processes, training jobs), SIGKILLing what outlives
# RECFORGE_DOWN_GRACE (30 s) after SIGTERM; fails, naming them, if anything survives.
down:
	scripts/services.sh down

status:
	scripts/services.sh status

bench: $(STAMP)
	@shopt -s nullglob; files=(bench/bench_*.py); failed=(); \
	if [ $${#files[@]} -eq 0 ]; then echo "no bench/bench_*.py yet"; exit 0; fi; \
	for f in "$${files[@]}"; do \
	    echo "=== $$f $(BENCH_ARGS)"; \
	    $(PY) "$$f" $(BENCH_ARGS) || failed+=("$$f"); \
	done; \
	if [ $${#failed[@]} -gt 0 ]; then echo "failed: $${failed[*]}" >&2; exit 1; fi

# Stops the services of this checkout's .recforge first (their pid files live there).
clean:
	@if compgen -G ".recforge/run/*.pid" >/dev/null; then RECFORGE_HOME="$(CURDIR)/.recforge" scripts/services.sh down; fi
	rm -rf .recforge

distclean: clean
	rm -rf $(VENV)

lock:
	scripts/lock.sh $(VENV)
	@if [ -f $(STAMP) ]; then touch $(STAMP); fi
