# kvpool — the two commands: `make demo` and `make test`. Both run the set-up first.
BUILD ?= build
JOBS ?= $(shell nproc)
BUILD_TYPE ?= RelWithDebInfo
KVPOOL_WERROR ?= OFF
KVPOOL_SANITIZE ?=
CMAKE_ARGS ?=

.PHONY: all setup configure build test demo format tidy clean

all: build

setup:
	@scripts/setup.sh $(BUILD)

configure: setup
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DKVPOOL_WERROR=$(KVPOOL_WERROR) -DKVPOOL_SANITIZE="$(KVPOOL_SANITIZE)" \
	  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON $(CMAKE_ARGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# Every test that needs no GPU: ctest (label gpu excluded), then pytest. Both always run (so
# both summaries print); the target fails if either failed.
test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE gpu; c=$$?; cd $(CURDIR); \
	  $(BUILD)/venv/bin/python -m pytest -q -rs python/tests; p=$$?; \
	  if [ $$c -ne 0 ]; then echo "make test: ctest failed (exit $$c)" >&2; fi; \
	  if [ $$p -ne 0 ]; then echo "make test: pytest failed (exit $$p)" >&2; fi; \
	  [ $$c -eq 0 ] && [ $$p -eq 0 ]

demo: build
	@scripts/demo.sh $(BUILD)

format:
	@git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i

tidy: configure
	@git ls-files '*.cc' | grep -v '^tests/' | xargs clang-tidy -p $(BUILD) --quiet

clean:
	@rm -rf $(BUILD)
