# The two commands of the README: `make demo` (set up + main job on the embedded default) and `make test`.
PARAMS ?= params/demo.yaml
PYTEST_ARGS ?=

.PHONY: setup demo test lab
setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/eagle3kit run $(PARAMS)

test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)

lab: setup
	.venv/bin/jupyter lab notebooks/
