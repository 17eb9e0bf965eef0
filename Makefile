# The two commands of the README: `make demo` (set up + main job on the embedded default) and `make test`.
PARAMS ?= params/demo.yaml
PYTEST_ARGS ?=

.PHONY: setup demo test lab
setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/eagle3kit run $(PARAMS)

# Two workers on the 2-core machine (tests that share a fixed resource carry an xdist_group mark: loadgroup keeps each
# group on one worker); the 15 slowest tests are printed at the end (addopts)
PYTEST_WORKERS ?= 2
test: setup
	.venv/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lab: setup
	.venv/bin/jupyter lab notebooks/
