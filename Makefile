# EdgeFL: `make demo` runs a federation on this machine; `make test` runs the tests.
# Both create .venv, install the project with the CPU build of torch, and make
# sure Mosquitto is installed (installing it with apt-get when run as root).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
DEMO_ARGS ?=

.PHONY: demo test setup mosquitto clean attacks fault-drill

demo: setup mosquitto
	$(BIN)/broker-coordinator simulate --out demo-out $(DEMO_ARGS)

test: setup mosquitto
	$(BIN)/python -m pytest -q

# benchmarks too slow for `make test`; each writes its results to bench/results/
attacks: setup            # bench/results/attacks.json, attacks.md (about an hour on 2 cores)
	$(BIN)/python -m bench.attacks

fault-drill: setup mosquitto  # bench/results/fault_drill.json, fault_drill.md (about 3 minutes)
	$(BIN)/python -m bench.fault_drill

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU wheel first, so the range in pyproject.toml never pulls a CUDA build
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

mosquitto:
	@if command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing mosquitto from the distribution's packages"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients; \
	else \
		echo "Mosquitto is missing. Install it, then run make again:"; \
		echo "    sudo apt-get install -y mosquitto mosquitto-clients"; \
		exit 1; \
	fi

clean:
	rm -rf $(VENV) demo-out .pytest_cache
