# Makefile - a thin wrapper over CMake (the build's single source of truth).
#   make            configure + build into build/ (CUDA kernels too when nvcc is found)
#   make test       build, then run every CPU test (the README's test command; CI runs it)
#   make gpu-test   run the GPU tests (needs a GPU; see scripts/gpu_check.sh for the full check)
#   make asan       CPU-only build with AddressSanitizer + UBSan (float-cast-overflow too: gcc leaves it
#                   out of "undefined"), then the CPU tests
#   make tsan       CPU-only build with ThreadSanitizer (pthreads for the CPU threads), then the CPU tests
#   make cpu        CPU-only build into build-cpu/
#   make clean
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

all:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

test: all
	ctest --test-dir $(BUILD) -LE gpu --output-on-failure -j $(JOBS)

gpu-test: all
	ctest --test-dir $(BUILD) -L gpu --output-on-failure

cpu:
	cmake -S . -B build-cpu -DKDT_CUDA=OFF -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build build-cpu -j $(JOBS)

asan:
	cmake -S . -B build-asan -DKDT_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug -DKDT_SANITIZE="address;undefined;float-cast-overflow"
	cmake --build build-asan -j $(JOBS)
	ctest --test-dir build-asan -LE gpu --output-on-failure -j $(JOBS)

tsan:
	cmake -S . -B build-tsan -DKDT_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug -DKDT_SANITIZE=thread
	cmake --build build-tsan -j $(JOBS)
	ctest --test-dir build-tsan -LE gpu --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD) build-cpu build-asan build-tsan build-nvcc

.PHONY: all test gpu-test cpu asan tsan clean
