# The two set-up commands of the README. Each installs (idempotently) what it needs first.
.PHONY: install install-test models profile serve demo test

install:
	bash scripts/install.sh

install-test:
	bash scripts/install.sh test

models: install
	.venv/bin/specdec models pull

# Optional: measure every installed exact configuration (mainline too, with SPECDEC_MAINLINE=1 make
# install) and save the fastest as this machine's default (three calibrations each, in turn,
# medians compared; about three minutes). Without it, the rule of runtime.default_config holds.
profile: models
	.venv/bin/specdec calibrate --configs exact --save --if-missing

# The main job: the OpenAI-compatible server on the default pair, http://127.0.0.1:8000/v1.
serve: models
	.venv/bin/specdec serve

# A single generation on the default pair, streamed, with its stats.
demo: models
	.venv/bin/specdec generate --chat --max-tokens 96 \
	  "Write a Python function that returns the n-th Fibonacci number, with a docstring."

# Both tiers in one run: hermetic unit tests (fake backend) and the real pair (loaded once per backend).
test: install-test models
	.venv/bin/ruff check src tests scripts
	.venv/bin/mypy
	.venv/bin/python -m pytest -q tests
