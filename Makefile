# mokd - GNU make build. `make` builds into build/, `make check` runs every
# CPU test, `make asan` the same under ASan+UBSan, `make bench-cpu` measures.

BUILD     ?= build
CUDA_HOME ?= /usr/local/cuda
CC        ?= cc
PYTHON    ?= $(shell for p in python3 /usr/bin/python3; do \
                $$p -c 'import numpy' >/dev/null 2>&1 && { command -v $$p; break; }; done)

CSTD      := -std=c11 -D_GNU_SOURCE
WARN      := -Wall -Wextra -Werror -Wno-psabi
# Bits must not depend on the compiler's mood: no contraction into FMA.
FPFLAGS   := -ffp-contract=off
ifeq ($(DEBUG),1)
OPT       := -O0 -g3
else
OPT       := -O2 -g
endif
ifeq ($(SAN),1)
OPT       += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
LDSAN     := -fsanitize=address,undefined
endif

INCLUDES  := -Iclient/include -Ikernels -Ikernels/cpu
CFLAGS    += $(CSTD) $(WARN) $(FPFLAGS) $(OPT) $(INCLUDES) -MMD -MP
LDLIBS    += -lm -lpthread

CHECK_CFLAGS := $(shell pkg-config --cflags check 2>/dev/null)
CHECK_LIBS   := $(shell pkg-config --libs check 2>/dev/null)

# ---- sources ------------------------------------------------------------
KERNEL_SRC := kernels/layer.c kernels/backend.c kernels/cpu/ops.c \
              kernels/cpu/pool.c kernels/cpu/cpu_moe.c client/errors.c
TEST_SRC   := tests/check_main.c tests/ref.c tests/check_bf16.c \
              tests/check_schedule.c tests/check_forward.c tests/check_backward.c \
              tests/check_determinism.c tests/check_ep.c tests/check_errors.c \
              tests/check_pool.c
BENCH_SRC  := tests/bench/bench_cpu.c

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))

KERNEL_OBJ := $(call obj,$(KERNEL_SRC))
TEST_OBJ   := $(call obj,$(TEST_SRC))
BENCH_OBJ  := $(call obj,$(BENCH_SRC))

LIBMOKK    := $(BUILD)/libmokk.a
CHECK_BIN  := $(BUILD)/tests/check_mokd
BENCH_BIN  := $(BUILD)/bench_cpu

.PHONY: all deps check check-run asan bench-cpu clean demo
.DEFAULT_GOAL := all

all: $(LIBMOKK) $(CHECK_BIN) $(BENCH_BIN)

deps:
	@bash deploy/install-deps.sh

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(TEST_OBJ): CFLAGS += $(CHECK_CFLAGS) -Itests

$(LIBMOKK): $(KERNEL_OBJ)
	@mkdir -p $(dir $@)
	$(AR) rcs $@ $^

$(CHECK_BIN): $(TEST_OBJ) $(LIBMOKK)
	@mkdir -p $(dir $@)
	$(CC) $(LDSAN) -o $@ $(TEST_OBJ) $(LIBMOKK) $(CHECK_LIBS) $(LDLIBS)

$(BENCH_BIN): $(BENCH_OBJ) $(LIBMOKK)
	$(CC) $(LDSAN) -o $@ $(BENCH_OBJ) $(LIBMOKK) $(LDLIBS)

# check runs deps first so a fresh machine needs nothing else; the suites are
# rebuilt with the freshly installed Check flags by a recursive make.
check: deps
	@$(MAKE) --no-print-directory check-run

check-run: $(CHECK_BIN)
	CK_FORK=yes $(CHECK_BIN)

asan: deps
	@$(MAKE) --no-print-directory BUILD=$(BUILD)/asan SAN=1 check-run

bench-cpu: $(BENCH_BIN)
	@test -n "$(PYTHON)" || { echo "bench-cpu: no python3 with numpy found (tried python3, /usr/bin/python3); run make deps" >&2; exit 1; }
	$(BENCH_BIN) --numpy "$(PYTHON) tests/bench/numpy_matmul.py"

demo:
	@echo "make demo arrives with the daemon (issue 3); for now run: make check" >&2
	@exit 1

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
