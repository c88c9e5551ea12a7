# The two entry points of README.md. Both build .venv from scratch when it is missing.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-system test-docker lint bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: pip then takes the local CPU build instead of a CUDA one
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/diloco-node demo

# unit + core integration (real nodes on loopback), two tests at a time (pytest-xdist): the
# machine's two cores, which one test's nodes leave partly idle while they wait on each other
test: $(VENV)/.installed
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --durations=15 tests/unit tests/integration

# network namespaces, browser, lifecycle stress, hostile peers (root, chromium, iproute2). Hostile
# peers and the browser two tests at a time (behaviour under attack, ephemeral ports); the link caps,
# partitions, scale and stop timings one at a time, since what they measure is the machine's share.
# Both halves run, so that one red half still reports the other.
test-system: $(VENV)/.installed
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --durations=15 tests/hostile tests/browser; first=$$?; \
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=15 tests/network tests/system; second=$$?; \
	test $$first -eq 0 && test $$second -eq 0

# docker/compose.yaml on a real Docker engine (root; starts dockerd when it is installed)
test-docker: $(VENV)/.installed
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=15 -s tests/docker

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check diloco_node harness tests benchmarks
	$(VENV)/bin/mypy diloco_node harness --ignore-missing-imports

bench: $(VENV)/.installed
	$(PY) benchmarks/diloco_vs_ddp.py
	$(PY) benchmarks/codecs.py
	$(PY) benchmarks/inner_loop.py --model llama-20m --batch-size 4 --seq-len 256  # the node's inner phase vs a plain loop
	$(PY) benchmarks/noloco.py
	$(PY) benchmarks/eager_loss.py --h 40 --rounds 12
	$(PY) benchmarks/matchmaking.py --syncs eager,blocking
	$(PY) benchmarks/wide_area.py  # network namespaces: needs root
	$(PY) benchmarks/headline.py  # network namespaces: needs root; time and bytes to DDP's loss
	$(PY) benchmarks/background.py  # network namespaces: needs root; an idle pair's bytes per second
	$(PY) benchmarks/scale.py  # after wide_area.py: its cost model is also fitted to the islands
	$(PY) benchmarks/partition.py  # network namespaces: needs root
	$(PY) benchmarks/islands.py  # docker/compose.yaml on a Docker engine: needs root

clean:
	rm -rf $(VENV) build *.egg-info
