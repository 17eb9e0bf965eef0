# The two commands of the README: `make demo` (set up + main job on the embedded default) and `make test`.
PARAMS ?= params/demo.yaml
PYTEST_ARGS ?=

.PHONY: setup demo test lab
setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/eagle3kit run $(PARAMS)

# Two workers on the 2-core machine, each given whole test modules in the order conftest sets (longest first), so a
# module's fixtures are made once; the 15 slowest tests are printed at the end (addopts)
PYTEST_WORKERS ?= 2
test: setup
	.venv/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lab: setup
	.venv/bin/jupyter lab notebooks/
