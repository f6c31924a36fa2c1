# The README's commands. `make test` works on a fresh machine: it installs what it needs, builds the
# native library, compiles the CUDA sources, then runs the GoogleTest and pytest suites.
PYTHON ?= python3
MAX_JOBS ?= 2
export MAX_JOBS
CPP_BUILD := build/cpp
TORCH_CMAKE = $(shell $(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)')

.PHONY: demo test deps build cpp-test cuda-compile py-test bench clean

demo: build
	$(PYTHON) -m hydra_torch.demo

test: build cpp-test cuda-compile py-test

deps: build/.deps-installed
build/.deps-installed: requirements-dev.txt
	$(PYTHON) -m pip install -q -r requirements-dev.txt
	mkdir -p build && touch $@

# In place, so that tests and the demo import the freshly built library from this checkout.
build: deps
	$(PYTHON) setup.py -q build_ext --inplace

cpp-test: deps
	cmake -S tests/cpp -B $(CPP_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$(TORCH_CMAKE)"
	cmake --build $(CPP_BUILD) -j $(MAX_JOBS)
	cd $(CPP_BUILD) && ctest --output-on-failure

cuda-compile: deps
	$(PYTHON) tools/compile_cuda.py

py-test: build
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf build hydra_torch/_C*.so
