# EdgeFL: `make demo` runs a federation on this machine; `make test` runs the tests;
# `make field` runs the field benchmark (bench/field.py -> bench/results/field.json, .md, .png)
# and `make field-quick` its smoke version (-> bench/results/field_quick.*).
# All create .venv, install the project with the CPU build of torch, and make
# sure Mosquitto is installed (installing it with apt-get when run as root).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
DEMO_ARGS ?=
# the demo's emulated fleet: each agent under a CPU quota and memory limit of its device class
# (broker_coordinator/fleet.py); without root, simulate says what is missing and runs without
DEMO_FLEET ?= zero2w:2,pi3:2,pi4:4,pi5:2
FIELD_ARGS ?=

.PHONY: demo test setup mosquitto clean field field-quick

demo: setup mosquitto
	$(BIN)/broker-coordinator simulate --out demo-out --fleet $(DEMO_FLEET) --round-timeout 6 $(DEMO_ARGS)

field: setup mosquitto
	nice -n 5 $(BIN)/python -m bench.field $(FIELD_ARGS)

field-quick: setup mosquitto
	nice -n 5 $(BIN)/python -m bench.field --quick $(FIELD_ARGS)

test: setup mosquitto
	$(BIN)/python -m pytest -q

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
