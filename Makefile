# Two commands on a fresh machine: `make demo` (build, verify and load the example cache)
# and `make test`. Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STORE ?= demo-store
SPEC ?= examples/kernelcache.yaml
SERVE_DIR ?= $(STORE)-serve

.PHONY: demo test test-quick test-all lint crds images load-images push-images bench clean vllm-sources

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cute,dev]'
	touch $@

# The tests also drive torch.compile, Triton and FlashInfer's JIT on the CPU, and the kopf
# operator against an emulated API server (with the real kubectl, installed into .tools/bin).
# torch is pinned first: that release is the CPU build, where an unpinned torch (asked for by
# FlashInfer too) would pull a multi-GB CUDA build.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q flashinfer-python==0.7.4 triton==3.6.0
	$(PY) -m pip install -q -e '.[cute,dev,operator]'
	bash scripts/install-kube-tools.sh
	touch $@

# Build the example cache for every arch of the spec (CPU is enough: CuTe-DSL cross-compiles),
# verify it as the init-container would, copy it out, then play the serving process: a fresh
# process that must find every kernel in the cache and compile none.
demo: $(VENV)/.installed
	$(VENV)/bin/kernelcache build -f $(SPEC) --store $(STORE)
	$(VENV)/bin/kernelcache inspect --store $(STORE)
	rm -rf $(SERVE_DIR) && mkdir -p $(SERVE_DIR)
	PYTHONPATH=examples $(VENV)/bin/kernelcache verify --store $(STORE) -f $(SPEC) --arch sm_90a \
		--check-env --materialize $(SERVE_DIR)
	CUTE_DSL_ARCH=sm_90a KERNELCACHE_STRICT=1 \
		KERNELCACHE_CUTE_DSL_DIR=$$(ls -d $(SERVE_DIR)/*/)files/cute-dsl \
		$(PY) examples/demo_serve.py

# pytest exits 5 when it collected no tests: that is a failure, not a pass. The system
# programs the tests drive (promtool, prometheus, g++) are installed when missing, as root;
# under CI a missing one fails the run instead of skipping its tests.
# The tests run side by side in PYTEST_WORKERS processes (pytest-xdist): much of their time is
# spent waiting on the processes they start, so more workers than cores pay. Each file stays on
# one worker, in order (a module's fixtures are built once; some files' tests build on the ones
# before), the longest files first (tests/conftest.py names them), then the others with slow
# tests.
# Three tiers (README, "Set-up on a fresh machine"):
#   test-quick  leaves out the `slow` tests (kill loops, real generations, the key matrix,
#               and those tests/tiers.py measured as costly);
#   test        everything but the `large` cases: what CI runs at every change;
#   test-all    everything, the `large` cases too (the same checks at scale: the operator
#               under 500 KernelCaches, 50 kills): CI's nightly run (.ci/nightly).
PYTEST_WORKERS ?= 6
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile
NO_TESTS := rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# The Python sources of the vLLM releases the compatibility tests read
# (tests/test_vllm_adapter.py; which ones: adapter.CHECKED_RELEASES), into .cache/vllm-sources:
# each release's source archive (38-51 MB, its sha256 checked), its .py files kept; a release
# already there is not fetched again.
vllm-sources: $(VENV)/.installed
	$(PY) scripts/fetch-vllm-sources.py

test: $(VENV)/.installed-test vllm-sources
	bash scripts/install-system-tools.sh
	$(PYTEST) -m "not large"; $(NO_TESTS)

test-quick: $(VENV)/.installed-test vllm-sources
	bash scripts/install-system-tools.sh
	$(PYTEST) -m "not slow and not large"; $(NO_TESTS)

test-all: $(VENV)/.installed-test vllm-sources
	bash scripts/install-system-tools.sh
	$(PYTEST); $(NO_TESTS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# The CRD, its API reference, the alert rules and the dashboard have one source each; the
# chart carries copies (tests fail on drift).
crds: $(VENV)/.installed
	$(PY) -m kernelcache.crd > crds/kernelcache.dev_kernelcaches.yaml
	$(PY) -m kernelcache.crd --api-docs > docs/api.md
	cp crds/kernelcache.dev_kernelcaches.yaml charts/kernelcache/files/
	cp prometheus/kernelcache-rules.yaml charts/kernelcache/files/
	cp prometheus/kernelcache-dashboard.json charts/kernelcache/files/

# The operator, init-container and demo engine images, named as the chart and the examples
# expect them, with whichever builder is installed (docker, podman, nerdctl, buildah); then
# into a local cluster (CLUSTER=kind or k3d) or a registry (REGISTRY=...). IMAGES, TAG,
# BUILDER and CLUSTER_NAME choose further: scripts/images.sh.
images:
	bash scripts/images.sh build

load-images:
	bash scripts/images.sh load

push-images:
	bash scripts/images.sh push

bench: $(VENV)/.installed
	$(PY) bench/cute_compile_vs_load.py
	$(PY) bench/cute_trace_cost.py
	$(PY) bench/verify_throughput.py
	$(PY) bench/verify_coldstart.py
	$(PY) bench/operator_scale.py

clean:
	rm -rf $(VENV) $(STORE) $(SERVE_DIR)
