# mokd - GNU make build. `make` builds into build/; `make check` runs the C
# unit and end-to-end suites, a short stress run, the Python suite, then
# gpu-check (which says it skipped when no GPU is visible); `make asan` runs
# the C suites under ASan+UBSan; `make stress` the whole stress run;
# `make bench-cpu` measures.

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

INCLUDES  := -Iclient/include -Iclient -Ikernels -Ikernels/cpu -Iproto -Idaemon -I$(BUILD)
CFLAGS    += $(CSTD) $(WARN) $(FPFLAGS) $(OPT) $(INCLUDES) -fPIC -MMD -MP
LDLIBS    += -lm -lpthread -ldl

CHECK_CFLAGS := $(shell pkg-config --cflags check 2>/dev/null)
CHECK_LIBS   := $(shell pkg-config --libs check 2>/dev/null)

# ---- CUDA (built whenever nvcc is there) -------------------------------------
NVCC      ?= $(CUDA_HOME)/bin/nvcc
HAVE_CUDA ?= $(shell test -x $(NVCC) && echo 1)
# sm_90a for Hopper, sm_100a for Blackwell, in one fatbin
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_100a,code=sm_100a
# --fmad=false for the same reason: the SwiGLU of kernels/swiglu.h is evaluated
# as written, on the GPU as on the CPU
NVFLAGS   := -std=c++17 -O3 -lineinfo --fmad=false $(CUDA_ARCH) -Xcompiler -fPIC,-Wall \
             -Ikernels -Iclient/include -Iproto
# cudart is linked statically and reaches the driver itself, so the binaries
# start on machines without one (they then report no device)
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lpthread -lstdc++
# the GPU machine has no Check package: GPU test binaries link it statically
CHECK_STATIC := -Wl,-Bstatic -lcheck_pic -lsubunit -Wl,-Bdynamic -lrt -lm

# ---- sources ------------------------------------------------------------
PROTO_C    := $(BUILD)/proto/mokd.pb-c.c
PROTO_H    := $(BUILD)/proto/mokd.pb-c.h
COMMON_SRC := client/errors.c client/paths.c proto/frame.c proto/fdpass.c proto/gpuid.c
KERNEL_SRC := kernels/layer.c kernels/backend.c kernels/cpu/ops.c \
              kernels/cpu/pool.c kernels/cpu/cpu_moe.c kernels/cpu/hostmem.c
DAEMON_SRC := daemon/main.c daemon/config.c daemon/log.c daemon/server.c daemon/conn.c \
              daemon/dispatch.c daemon/session.c daemon/arenas.c daemon/layers.c \
              daemon/steps.c daemon/results.c daemon/groups.c daemon/registry.c daemon/executor.c \
              daemon/notify.c daemon/idmap.c daemon/admin.c daemon/metrics.c daemon/http.c \
              daemon/httpreq.c daemon/progress.c daemon/wfq.c daemon/placement.c kernels/devices.c
CLIENT_SRC := client/mok.c client/cudamap.c client/impcache.c client/tuning.c
UNIT_SRC   := tests/check_main.c tests/ref.c tests/check_bf16.c \
              tests/check_schedule.c tests/check_forward.c tests/check_backward.c \
              tests/check_determinism.c tests/check_ep.c tests/check_errors.c \
              tests/check_pool.c tests/check_frame.c tests/check_config.c \
              tests/check_registry.c
UNIT_SRC   += tests/check_paths.c tests/check_wfq.c
UNIT_SRC   += tests/check_mokctl.c tests/check_idmap.c tests/check_gpuid.c tests/check_ops.c
UNIT_SRC   += tests/check_impcache.c tests/check_placement.c
# config.c, log.c, registry.c, idmap.c, httpreq.c and progress.c are unit-tested
# without the rest of the daemon
UNIT_DAEMON := daemon/config.c daemon/log.c daemon/registry.c daemon/idmap.c \
               daemon/httpreq.c daemon/progress.c daemon/wfq.c daemon/placement.c
INTEG_SRC  := tests/check_daemon.c tests/daemon_fixture.c tests/check_daemon_steps.c \
              tests/check_daemon_wire.c tests/check_daemon_service.c tests/ref.c \
              tests/check_daemon_limits.c tests/check_daemon_ep.c tests/check_daemon_fair.c \
              tests/check_daemon_tenants.c
BENCH_SRC  := tests/bench/bench_cpu.c
CUDA_SRC   := kernels/cuda/cuda_moe.cu kernels/cuda/cuda_backend.cu kernels/cuda/gpumem.cu \
              kernels/cuda/ipc.cu kernels/cuda/route.cu kernels/cuda/sm90/tma.cu

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))

COMMON_OBJ := $(call obj,$(COMMON_SRC)) $(BUILD)/obj/proto/mokd.pb-c.o
KERNEL_OBJ := $(call obj,$(KERNEL_SRC))
DAEMON_OBJ := $(call obj,$(DAEMON_SRC))
CLIENT_OBJ := $(call obj,$(CLIENT_SRC))
UNIT_OBJ   := $(call obj,$(UNIT_SRC)) $(call obj,$(UNIT_DAEMON))
UNIT_OBJ   += $(call obj,client/mokctl_opts.c client/impcache.c client/tuning.c)
INTEG_OBJ  := $(call obj,$(INTEG_SRC))
BENCH_OBJ  := $(call obj,$(BENCH_SRC))
TOOL_OBJ   := $(call obj,client/testbed.c client/mokctl.c client/examples/mok_demo.c)
CUDA_OBJ   := $(patsubst %.cu,$(BUILD)/obj/%.o,$(CUDA_SRC))

LIBCOMMON  := $(BUILD)/libmokcommon.a
LIBMOKK    := $(BUILD)/libmokk.a
LIBMOK_A   := $(BUILD)/libmok.a
LIBMOK_SO  := $(BUILD)/libmok.so
# libmok.so -> libmok.so.MAJOR (the soname) -> libmok.so.MAJOR.MINOR.PATCH,
# the numbers from mok.h
mok_ver = $(shell sed -n 's/^\#define MOK_VERSION_$(1) \([0-9]*\)$$/\1/p' client/include/mok.h)
LIBMOK_MAJOR   := $(call mok_ver,MAJOR)
LIBMOK_VERSION := $(LIBMOK_MAJOR).$(call mok_ver,MINOR).$(call mok_ver,PATCH)
LIBMOK_REAL    := $(BUILD)/libmok.so.$(LIBMOK_VERSION)
MOKD_BIN   := $(BUILD)/mokd
MOKCTL_BIN := $(BUILD)/mokctl
DEMO_BIN   := $(BUILD)/mok_demo
UNIT_BIN   := $(BUILD)/tests/check_mokd
INTEG_BIN  := $(BUILD)/tests/check_daemon
BENCH_BIN  := $(BUILD)/bench_cpu
STRESS_BIN := $(BUILD)/tests/stress
PC_FILE    := $(BUILD)/mok.pc
LIBMOKK_CUDA := $(BUILD)/libmokk_cuda.a
GPU_BIN    := $(BUILD)/tests/check_gpu
GPU_BENCH  := $(BUILD)/bench_gpu
GEMM_BENCH := $(BUILD)/bench_gemm
ifeq ($(HAVE_CUDA),1)
CUDA_TARGETS := $(LIBMOKK_CUDA) $(GPU_BIN) $(GPU_BENCH) $(GEMM_BENCH)
endif

PROTOBUF_LIBS := $(shell pkg-config --libs libprotobuf-c 2>/dev/null || echo -lprotobuf-c)
# the shared client always links the shared protobuf-c (the archive is not PIC)
PROTOBUF_SO   := $(PROTOBUF_LIBS)
DAEMON_LIBS   := $(shell pkg-config --libs libuv inih libsystemd 2>/dev/null || echo -luv -linih -lsystemd) $(PROTOBUF_LIBS)
# STATIC_DEPS=1: libuv, inih and protobuf-c linked in, for machines that lack
# the packages (the GPU machine); libsystemd and libc stay shared
ifeq ($(STATIC_DEPS),1)
PROTOBUF_LIBS := -l:libprotobuf-c.a
DAEMON_LIBS   := -l:libuv_a.a -l:libinih.a -l:libprotobuf-c.a -lsystemd
endif

PREFIX ?= /usr/local

.PHONY: all deps check check-run check-c check-python check-deploy asan bench-cpu bench bench-gpu clean \
        demo demo-run install gpu-check bench-gemm stress
.DEFAULT_GOAL := all

all: $(MOKD_BIN) $(MOKCTL_BIN) $(DEMO_BIN) $(LIBMOK_A) $(LIBMOK_SO) $(PC_FILE) \
     $(UNIT_BIN) $(INTEG_BIN) $(BENCH_BIN) $(STRESS_BIN) $(CUDA_TARGETS)

deps:
	@bash deploy/install-deps.sh

$(PROTO_C) $(PROTO_H): proto/mokd.proto
	@mkdir -p $(BUILD)
	protoc-c --c_out=$(BUILD) proto/mokd.proto

# every object may include the generated header
$(BUILD)/obj/%.o: %.c | $(PROTO_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/obj/proto/mokd.pb-c.o: $(PROTO_C)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Wno-unused-parameter -c $< -o $@

$(call obj,$(UNIT_SRC) $(INTEG_SRC)): CFLAGS += $(CHECK_CFLAGS) -Itests

$(BUILD)/obj/%.o: %.cu $(wildcard kernels/cuda/*.cuh kernels/cuda/*.h kernels/cuda/sm90/*) \
                   kernels/layer.h kernels/backend.h kernels/backend_impl.h kernels/swiglu.h \
                   client/include/mok_errno.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

$(call obj,tests/gpu/check_gpu.c tests/bench/bench_gpu.c tests/bench/bench_gemm.c \
  tests/bench/trace.c): CFLAGS += $(CHECK_CFLAGS) -Itests \
	-isystem $(CUDA_HOME)/include

$(BUILD)/obj/tests/gpu/gemm_core.o $(BUILD)/obj/tests/gpu/schedule.o \
  $(BUILD)/obj/tests/gpu/dispatch.o $(BUILD)/obj/tests/bench/read_pattern.o: \
  NVFLAGS += -Ikernels/cuda

$(LIBMOKK_CUDA): $(CUDA_OBJ)
	$(AR) rcs $@ $^
$(GPU_BIN): $(call obj,tests/gpu/check_gpu.c tests/ref.c kernels/devices.c) \
            $(BUILD)/obj/tests/gpu/gate.o $(BUILD)/obj/tests/gpu/schedule.o \
            $(BUILD)/obj/tests/gpu/dispatch.o \
            $(BUILD)/obj/tests/gpu/gemm_core.o $(LIBMOK_A) $(LIBMOKK_CUDA) $(LIBMOKK) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDSAN) -o $@ $^ $(CHECK_STATIC) -l:libprotobuf-c.a $(CUDA_LIBS) $(LDLIBS)
$(GPU_BENCH): $(call obj,tests/bench/bench_gpu.c tests/bench/trace.c kernels/devices.c) \
              $(BUILD)/obj/tests/bench/gpu_fill.o \
              $(LIBMOK_A) $(LIBMOKK_CUDA) $(LIBMOKK) $(LIBCOMMON)
	$(CC) $(LDSAN) -o $@ $^ -l:libprotobuf-c.a $(CUDA_LIBS) $(LDLIBS)
$(GEMM_BENCH): $(call obj,tests/bench/bench_gemm.c) $(BUILD)/obj/tests/gpu/gemm_core.o \
               $(BUILD)/obj/tests/bench/read_pattern.o $(LIBMOKK_CUDA) $(LIBMOKK)
	$(CC) $(LDSAN) -o $@ $^ $(CUDA_LIBS) $(LDLIBS)

$(LIBCOMMON): $(COMMON_OBJ)
	$(AR) rcs $@ $^
$(LIBMOKK): $(KERNEL_OBJ)
	$(AR) rcs $@ $^
$(LIBMOK_A): $(CLIENT_OBJ) $(COMMON_OBJ)
	$(AR) rcs $@ $^
# libmok.so exports the functions its public headers declare and nothing else
# (protobuf-c's generated code, the framing, helpers shared with the daemon
# stay inside): a version script made from the headers
LIBMOK_MAP := $(BUILD)/libmok.map
LIBMOK_HDR := client/include/mok.h client/include/mok_errno.h
$(LIBMOK_MAP): $(LIBMOK_HDR)
	@mkdir -p $(dir $@)
	{ echo 'LIBMOK_$(LIBMOK_MAJOR) {'; echo '  global:'; \
	  grep -ohE '\bmok_[a-z0-9_]+ *\(' $(LIBMOK_HDR) | tr -d ' (' | sort -u | sed 's/.*/    &;/'; \
	  echo '  local: *;'; echo '};'; } > $@
$(LIBMOK_REAL): $(CLIENT_OBJ) $(COMMON_OBJ) $(LIBMOK_MAP)
	$(CC) $(LDSAN) -shared -Wl,-soname,libmok.so.$(LIBMOK_MAJOR) \
	  -Wl,--version-script=$(LIBMOK_MAP) -o $@ $(CLIENT_OBJ) $(COMMON_OBJ) \
	  $(PROTOBUF_SO) -ldl -lpthread
$(LIBMOK_SO): $(LIBMOK_REAL)
	ln -sf libmok.so.$(LIBMOK_VERSION) $(BUILD)/libmok.so.$(LIBMOK_MAJOR)
	ln -sf libmok.so.$(LIBMOK_MAJOR) $@

$(PC_FILE): Makefile
	@printf 'prefix=%s\nlibdir=$${prefix}/lib\nincludedir=$${prefix}/include\n\nName: mok\nDescription: client library of the mokd MoE daemon\nVersion: $(LIBMOK_VERSION)\nRequires.private: libprotobuf-c\nLibs: -L$${libdir} -lmok\nCflags: -I$${includedir}\n' '$(PREFIX)' > $@

ifeq ($(HAVE_CUDA),1)
$(DAEMON_OBJ) $(call obj,$(UNIT_DAEMON) tests/check_config.c tests/check_daemon_service.c): \
  CFLAGS += -DMOKK_HAVE_CUDA
$(MOKD_BIN): $(DAEMON_OBJ) $(LIBMOKK_CUDA) $(LIBMOKK) $(LIBCOMMON)
	$(CC) $(LDSAN) -o $@ $^ $(DAEMON_LIBS) $(CUDA_LIBS) $(LDLIBS)
else
$(MOKD_BIN): $(DAEMON_OBJ) $(LIBMOKK) $(LIBCOMMON)
	$(CC) $(LDSAN) -o $@ $^ $(DAEMON_LIBS) $(LDLIBS)
endif
$(MOKCTL_BIN): $(call obj,client/mokctl.c client/mokctl_opts.c client/testbed.c) $(LIBMOK_A)
	$(CC) $(LDSAN) -o $@ $^ $(PROTOBUF_LIBS) $(LDLIBS)
$(DEMO_BIN): $(call obj,client/examples/mok_demo.c client/testbed.c) $(LIBMOK_A) $(LIBMOKK)
	$(CC) $(LDSAN) -o $@ $^ $(PROTOBUF_LIBS) $(LDLIBS)

$(UNIT_BIN): $(UNIT_OBJ) $(LIBMOKK) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(LDSAN) -o $@ $^ $(CHECK_LIBS) -linih $(PROTOBUF_LIBS) $(LDLIBS)
$(INTEG_BIN): $(INTEG_OBJ) $(call obj,client/testbed.c) $(LIBMOK_A) $(LIBMOKK)
	@mkdir -p $(dir $@)
	$(CC) $(LDSAN) -o $@ $^ $(CHECK_LIBS) $(PROTOBUF_LIBS) $(LDLIBS)
$(BENCH_BIN): $(BENCH_OBJ) $(LIBMOKK) $(LIBCOMMON)
	$(CC) $(LDSAN) -o $@ $^ $(LDLIBS)
$(STRESS_BIN): $(call obj,tests/stress/stress.c client/testbed.c) $(LIBMOK_A) $(LIBMOKK)
	@mkdir -p $(dir $@)
	$(CC) $(LDSAN) -o $@ $^ $(PROTOBUF_LIBS) $(LDLIBS)

# check runs deps first so a fresh machine needs nothing else; the build is a
# recursive make so that it sees the freshly installed pkg-config files.
check: deps
	@$(MAKE) --no-print-directory check-run

check-run: check-c check-python check-deploy gpu-check

check-c: all
	CK_FORK=yes $(UNIT_BIN)
	CK_FORK=yes MOKD_BIN=$(MOKD_BIN) $(INTEG_BIN)
	MOKD_BIN=$(MOKD_BIN) $(STRESS_BIN) --short
	bash tests/check_symbols.sh $(BUILD)

check-python: $(MOKD_BIN) $(LIBMOK_SO)
	@test -n "$(PYTHON)" || { echo "check: no python3 with numpy (tried python3, /usr/bin/python3); run make deps" >&2; exit 1; }
	MOKD_BIN=$(MOKD_BIN) MOK_LIB=$(LIBMOK_SO) PYTHONPATH=client/python $(PYTHON) -m unittest discover -s tests/python -v

# deploy/k8s (a schema check of the manifests) and deploy/slurm (shellcheck, and
# the prolog, task prolog and epilog against a real mokd)
check-deploy: $(MOKD_BIN) $(MOKCTL_BIN) $(LIBMOK_SO)
	@test -n "$(PYTHON)" || { echo "check: no python3 with numpy (tried python3, /usr/bin/python3); run make deps" >&2; exit 1; }
	bash tests/check_deploy.sh $(BUILD) $(PYTHON)

# a mokd under killed, crowding, unread and input-flipping clients (tests/stress);
# on the ASan build: make stress BUILD=build/asan SAN=1
stress: $(STRESS_BIN) $(MOKD_BIN)
	MOKD_BIN=$(MOKD_BIN) $(STRESS_BIN)

# the Python suite loads libmok into an uninstrumented interpreter: C suites only
asan: deps
	@$(MAKE) --no-print-directory BUILD=$(BUILD)/asan SAN=1 check-c

demo: deps
	@$(MAKE) --no-print-directory demo-run

demo-run: $(MOKD_BIN) $(MOKCTL_BIN) $(DEMO_BIN)
	@bash client/examples/demo.sh $(BUILD)

bench-cpu: $(BENCH_BIN)
	@test -n "$(PYTHON)" || { echo "bench-cpu: no python3 with numpy found (tried python3, /usr/bin/python3); run make deps" >&2; exit 1; }
	$(BENCH_BIN) --numpy "$(PYTHON) tests/bench/numpy_matmul.py"

# on the GPU machine; without a GPU (or without nvcc) they say so and pass
gpu-check:
ifeq ($(HAVE_CUDA),1)
	@$(MAKE) --no-print-directory $(GPU_BIN) $(MOKD_BIN) $(LIBMOK_SO)
	CK_FORK=no MOKD_BIN=$(MOKD_BIN) $(GPU_BIN)
	@if $(TORCH_PY) -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
	    >/dev/null 2>&1; then \
	  echo "MOKD_BIN=$(MOKD_BIN) MOK_LIB=$(LIBMOK_SO) PYTHONPATH=client/python $(TORCH_PY) -m pytest -q -s tests/python/test_torch.py tests/python/test_megatron.py"; \
	  MOKD_BIN=$(MOKD_BIN) MOK_LIB=$(LIBMOK_SO) PYTHONPATH=client/python \
	    $(TORCH_PY) -m pytest -q -s tests/python/test_torch.py tests/python/test_megatron.py; \
	else \
	  echo "gpu-check: no PyTorch with CUDA in $(TORCH_PY); the PyTorch client tests skipped"; \
	fi
else
	@echo "gpu-check: nvcc not found at $(NVCC) (set CUDA_HOME); GPU tests skipped"
endif

TORCH_PY = $(or $(TORCH_PYTHON),python3)

bench-gpu:
ifeq ($(HAVE_CUDA),1)
	@$(MAKE) --no-print-directory $(GPU_BENCH)
	$(GPU_BENCH) --verify --torch "$(TORCH_PY) tests/bench/torch_moe.py --steps" \
	  --ceiling "$(TORCH_PY) tests/bench/torch_matmul.py" --csv $(BUILD)/bench_gpu.csv
	$(TORCH_PY) tests/bench/plot_bench.py $(BUILD)/bench_gpu.csv $(BUILD)/bench_gpu.png
else
	@echo "bench-gpu: nvcc not found at $(NVCC) (set CUDA_HOME); nothing to measure"
endif

bench-gemm:
ifeq ($(HAVE_CUDA),1)
	@$(MAKE) --no-print-directory $(GEMM_BENCH)
	$(GEMM_BENCH) --torch "$(TORCH_PY) tests/bench/torch_matmul.py"
else
	@echo "bench-gemm: nvcc not found at $(NVCC) (set CUDA_HOME); nothing to measure"
endif

bench: bench-cpu bench-gpu

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include \
	  $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 755 $(MOKD_BIN) $(MOKCTL_BIN) $(DESTDIR)$(PREFIX)/bin
	install -m 644 $(LIBMOK_A) $(DESTDIR)$(PREFIX)/lib
	install -m 755 $(LIBMOK_REAL) $(DESTDIR)$(PREFIX)/lib
	ln -sf libmok.so.$(LIBMOK_VERSION) $(DESTDIR)$(PREFIX)/lib/libmok.so.$(LIBMOK_MAJOR)
	ln -sf libmok.so.$(LIBMOK_MAJOR) $(DESTDIR)$(PREFIX)/lib/libmok.so
	install -m 644 client/include/mok.h client/include/mok_errno.h $(DESTDIR)$(PREFIX)/include
	install -m 644 $(PC_FILE) $(DESTDIR)$(PREFIX)/lib/pkgconfig

# ---- fuzzing: `make fuzz [FUZZ_SECONDS=N]`, with clang's libFuzzer ------------
# Not part of check (clang is not a build dependency). New inputs go to
# $(BUILD)/fuzz/corpus; the seeds in tests/fuzz/corpus are only read.
.PHONY: fuzz
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_DIR     := $(BUILD)/fuzz
FUZZ_CFLAGS  := $(CSTD) -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
                -Iclient/include -Iproto -I$(BUILD)
FUZZ_FRAME   := $(FUZZ_DIR)/fuzz_frame
FUZZ_REQUEST := $(FUZZ_DIR)/fuzz_request
# the request harness runs the daemon's own code, all but main.c, on the CPU backend
FUZZ_REQ_SRC := tests/fuzz/fuzz_request.c \
                $(filter-out daemon/main.c kernels/devices.c,$(DAEMON_SRC)) \
                $(KERNEL_SRC) $(COMMON_SRC) $(PROTO_C)

fuzz:
	@command -v $(FUZZ_CC) >/dev/null 2>&1 || { echo "fuzz: $(FUZZ_CC) not found; libFuzzer comes with clang (apt-get install clang, or set FUZZ_CC)" >&2; exit 1; }
	@$(MAKE) --no-print-directory $(FUZZ_FRAME) $(FUZZ_REQUEST)
	@mkdir -p $(FUZZ_DIR)/corpus/frame $(FUZZ_DIR)/corpus/request
	$(FUZZ_FRAME) -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	  -artifact_prefix=$(FUZZ_DIR)/ $(FUZZ_DIR)/corpus/frame tests/fuzz/corpus/frame
	$(FUZZ_REQUEST) -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 -timeout=10 \
	  -artifact_prefix=$(FUZZ_DIR)/request- $(FUZZ_DIR)/corpus/request tests/fuzz/corpus/request

# CI's pass: both harnesses from the committed seeds alone, a fixed seed and a
# fixed number of runs, so that a run here and one in CI are the same run.
.PHONY: fuzz-ci
FUZZ_CI_RUNS ?= 400000 40000
fuzz-ci:
	@command -v $(FUZZ_CC) >/dev/null 2>&1 || { echo "fuzz-ci: $(FUZZ_CC) not found (bash deploy/install-deps.sh --fuzz)" >&2; exit 1; }
	@$(MAKE) --no-print-directory $(FUZZ_FRAME) $(FUZZ_REQUEST)
	@rm -rf $(FUZZ_DIR)/ci && mkdir -p $(FUZZ_DIR)/ci/frame $(FUZZ_DIR)/ci/request
	$(FUZZ_FRAME) -seed=1 -runs=$(word 1,$(FUZZ_CI_RUNS)) -print_final_stats=1 \
	  -artifact_prefix=$(FUZZ_DIR)/ci/ $(FUZZ_DIR)/ci/frame tests/fuzz/corpus/frame
	$(FUZZ_REQUEST) -seed=1 -runs=$(word 2,$(FUZZ_CI_RUNS)) -print_final_stats=1 -timeout=10 \
	  -artifact_prefix=$(FUZZ_DIR)/ci/request- $(FUZZ_DIR)/ci/request tests/fuzz/corpus/request

# regenerates the committed seeds of the request harness
.PHONY: fuzz-seeds
fuzz-seeds: $(LIBCOMMON)
	@mkdir -p $(FUZZ_DIR) tests/fuzz/corpus/request
	$(CC) $(CSTD) $(WARN) $(OPT) $(INCLUDES) -o $(FUZZ_DIR)/seed_request \
	  tests/fuzz/seed_request.c $(LIBCOMMON) $(PROTOBUF_LIBS)
	$(FUZZ_DIR)/seed_request tests/fuzz/corpus/request

$(FUZZ_FRAME): tests/fuzz/fuzz_frame.c proto/frame.c proto/frame.h $(PROTO_C) $(PROTO_H)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ tests/fuzz/fuzz_frame.c proto/frame.c $(PROTO_C) $(PROTOBUF_LIBS)

$(FUZZ_REQUEST): $(FUZZ_REQ_SRC) $(wildcard daemon/*.h kernels/*.h kernels/cpu/*.h proto/*.h) $(PROTO_H)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(INCLUDES) -ffp-contract=off -o $@ $(FUZZ_REQ_SRC) $(DAEMON_LIBS) \
	  -lm -lpthread -ldl

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
