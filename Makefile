# The README's commands. Both work on a fresh machine with Python and a C++ compiler: they install what they
# need (Python packages with pip; CMake, Ninja and GoogleTest with apt-get when run as root, else they name
# them and stop), install this checkout in editable mode, build the native library in place and run.
PYTHON ?= python3
MAX_JOBS ?= 2
export MAX_JOBS
CPP_BUILD := build/cpp
TORCH_CMAKE = $(shell $(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)')
# The interpreter itself, not a launcher script (pyenv's shims are shell scripts): python_tests_tsan preloads
# ThreadSanitizer into it.
PYTHON_BINARY = $(shell $(PYTHON) -c 'import sys; print(sys.executable)')
# One set of stamps per Python environment: a new virtual environment installs its packages again.
STAMPS := build/stamps/$(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])')

.PHONY: demo test deps install build system-deps cpp-test cuda-compile py-test clean

demo: build
	$(PYTHON) -m hydra_torch.demo

test: build cpp-test cuda-compile py-test

deps: $(STAMPS)/deps
$(STAMPS)/deps: requirements-dev.txt
	$(PYTHON) -m pip install -q -r requirements-dev.txt
	mkdir -p $(@D) && touch $@

# An editable install, so that every Python process (a Jupyter kernel, a subprocess) imports this checkout.
# It registers the path only; the extension is built in place below, incrementally.
install: $(STAMPS)/install
$(STAMPS)/install: $(STAMPS)/deps pyproject.toml setup.py
	HYDRA_SKIP_EXTENSION=1 $(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	mkdir -p $(@D) && touch $@

build: install
	tools/system_deps.sh build
	$(PYTHON) setup.py -q build_ext --inplace

system-deps:
	tools/system_deps.sh test

cpp-test: deps system-deps
	cmake -S tests/cpp -B $(CPP_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$(TORCH_CMAKE)" \
	  -DPython3_EXECUTABLE="$(PYTHON_BINARY)"
	cmake --build $(CPP_BUILD) -j $(MAX_JOBS)
	cd $(CPP_BUILD) && ctest --output-on-failure

cuda-compile: deps
	$(PYTHON) tools/compile_cuda.py

py-test: build
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf build hydra_torch/_C*.so
