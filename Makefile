# cpar — build, test, bench, demo.
#
#   make              build/libcpar.a and build/cparrun (CUDA + NCCL when found)
#   make test         host, sim and nccl-sim suites; the GPU suite too when a GPU is present
#   make test-sanitize  the host suites under ASan + UBSan (build/asan)
#   make demo         the main job (examples/train.c): train a byte-level GPT with tp x cp (x dp)
#   make collectives  a tour of the raw collectives on a tp x cp grid (examples/collectives.c)
#   make bench        benchmarks (bench/)
#   make CPAR_CUDA=0  force a host-only build
#
# Outputs go to build/: build/host (host-only objects and suites), build/sim
# (the CUDA simulator build: cpar_kernels.cu compiled by g++ with
# tests/cudasim.h), build/ncclsim (cpar.c compiled exactly as for GPUs, linked
# with the sim kernels and the NCCL simulator of tests/ncclsim), build/cuda
# (nvcc + NCCL). Each CUDA object is compiled once.

CC       ?= cc
CXX      ?= g++
CUDA_HOME ?= /usr/local/cuda
NVCC     ?= $(CUDA_HOME)/bin/nvcc
CUDA_ARCH ?= 80 90

# CUDA is used when nvcc and nccl.h are both found (override with CPAR_CUDA=0/1).
NCCL_INC := $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h /usr/local/include/nccl.h))
ifeq ($(origin CPAR_CUDA),undefined)
  CPAR_CUDA := $(if $(and $(wildcard $(NVCC)),$(NCCL_INC)),1,0)
endif
NCCL_LIBDIR := $(dir $(firstword $(wildcard $(CUDA_HOME)/lib64/libnccl.so $(CUDA_HOME)/lib/libnccl.so \
                 /usr/lib/x86_64-linux-gnu/libnccl.so /usr/lib/aarch64-linux-gnu/libnccl.so /usr/local/lib/libnccl.so)))

# A CBLAS for the host GEMM's F32 products: OpenBLAS or BLIS, found like NCCL
# (CPAR_BLAS=0 turns it off, CPAR_BLAS=1 insists). Netlib's reference CBLAS is
# slower than cpar's own kernel and is never picked. make bench compares with
# the CBLAS whenever one is installed.
TRIPLET  := $(shell $(CC) -dumpmachine 2>/dev/null)
BLAS_INC := $(firstword $(wildcard /usr/include/$(TRIPLET)/cblas.h /usr/include/cblas.h /usr/include/openblas/cblas.h \
              /usr/include/blis/cblas.h /usr/local/include/cblas.h))
BLAS_LIB := $(firstword $(foreach l,openblas blis,$(if $(wildcard /usr/lib/$(TRIPLET)/lib$(l).so /usr/lib64/lib$(l).so \
              /usr/lib/lib$(l).so /usr/local/lib/lib$(l).so),$(l))))
BLAS_FOUND := $(if $(and $(BLAS_INC),$(BLAS_LIB)),1,0)
ifeq ($(origin CPAR_BLAS),undefined)
  CPAR_BLAS := $(BLAS_FOUND)
endif
BLAS_DIR   := $(filter-out /usr/include/ /usr/include/$(TRIPLET)/,$(dir $(BLAS_INC)))
BLAS_CFLAGS := $(if $(filter 1,$(CPAR_BLAS)),-DCPAR_WITH_CBLAS $(if $(BLAS_DIR),-isystem $(BLAS_DIR)))
BLAS_LIBS   := $(if $(filter 1,$(CPAR_BLAS)),-l$(BLAS_LIB))
BENCH_BLAS  := $(if $(filter 1,$(BLAS_FOUND)),-DCPAR_BENCH_CBLAS $(if $(BLAS_DIR),-isystem $(BLAS_DIR)))
BENCH_BLAS_LIBS := $(if $(filter 1,$(BLAS_FOUND)),-l$(BLAS_LIB))

WARN      := -Wall -Wextra -Wpedantic
CFLAGS    ?= -O2 -g
CXXFLAGS  ?= -O1 -g
ALL_CFLAGS   := -std=c11 $(WARN) $(CFLAGS) -pthread -I. $(BLAS_CFLAGS)
SIM_CXXFLAGS := -std=c++17 -Wall -Wextra $(CXXFLAGS) -pthread -I. -DCPAR_SIM
NVCCFLAGS ?= -O3 -std=c++17 $(foreach a,$(CUDA_ARCH),-gencode arch=compute_$(a),code=sm_$(a)) \
             -Xcompiler -Wall,-Wextra -I.
CHECK_FLAGS := $(shell pkg-config --cflags check 2>/dev/null)
CHECK_LIBS  := $(shell pkg-config --libs check 2>/dev/null || echo -lcheck -lsubunit -lrt -lm -pthread)
comma := ,
CUDA_LIBS   := -L$(CUDA_HOME)/lib64 $(if $(NCCL_LIBDIR),-L$(NCCL_LIBDIR)) -lnccl -lcublas -lcudart \
               -Wl$(comma)-rpath$(comma)$(CUDA_HOME)/lib64 $(if $(NCCL_LIBDIR),-Wl$(comma)-rpath$(comma)$(NCCL_LIBDIR))
LIBS        := -pthread -lm $(BLAS_LIBS)

B := build

ifeq ($(CPAR_CUDA),1)
  LIB_OBJS  := $(B)/cuda/cpar.o $(B)/cuda/cpar_kernels.o
  LIB_LIBS  := $(CUDA_LIBS) $(LIBS) -lstdc++
else
  LIB_OBJS  := $(B)/host/cpar.o
  LIB_LIBS  := $(LIBS)
endif

# Suites that take a backend run on host, sim and nccl-sim; the rest are
# host-only (processes, sockets) or sim-only (the simulator and the device layer).
BACKEND_SUITES := core coll grid faults ops rng mappings xent linear attn ring mamba inference train
HOST_SUITES    := $(BACKEND_SUITES) store cparrun trainjob fuzz
SIM_SUITES     := $(BACKEND_SUITES) cudasim devlayer mma attn_bwd trainjob
# nccl-sim runs every backend suite on CPAR_BACKEND_NCCL, the simulator's own
# suite, the GPU suite's bodies, and multi-process jobs under cparrun.
NCCLSIM_SUITES := $(BACKEND_SUITES) ncclsim gpu mp trainjob
HOST_TESTS := $(HOST_SUITES:%=$(B)/host/test_%)
SIM_TESTS  := $(SIM_SUITES:%=$(B)/sim/test_%)
NCCLSIM_TESTS := $(NCCLSIM_SUITES:%=$(B)/ncclsim/test_%) $(B)/ncclsim/mp_prog
GPU_TEST   := $(if $(filter 1,$(CPAR_CUDA)),$(B)/cuda/test_gpu)
TEST_PROGS := $(B)/host/store_prog

.PHONY: all lib test test-host test-sim test-ncclsim test-gpu test-sanitize demo collectives bench plots clean
.SECONDARY: # keep the test objects that several flavours link
all: lib $(B)/cparrun $(B)/train
lib: $(B)/libcpar.a

$(B)/host $(B)/sim $(B)/ncclsim $(B)/cuda $(B)/asan:
	@mkdir -p $@

# ---- library -------------------------------------------------------------
HDR := cpar.h

$(B)/host/cpar.o: cpar.c $(HDR) | $(B)/host
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(B)/cuda/cpar.o: cpar.c $(HDR) | $(B)/cuda
	$(CC) $(ALL_CFLAGS) -DCPAR_WITH_DEVICE -DCPAR_WITH_NCCL -isystem $(CUDA_HOME)/include -c $< -o $@

$(B)/cuda/cpar_kernels.o: cpar_kernels.cu $(HDR) | $(B)/cuda
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(B)/libcpar.a: $(LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(B)/cparrun: bootstrap/cparrun.c | $(B)/host
	$(CC) $(ALL_CFLAGS) $< -o $@

# ---- sim build -------------------------------------------------------------
$(B)/sim/cpar.o: cpar.c $(HDR) | $(B)/sim
	$(CC) $(ALL_CFLAGS) -DCPAR_WITH_DEVICE -DCPAR_SIM -c $< -o $@

$(B)/sim/cpar_kernels.o: cpar_kernels.cu tests/cudasim.h $(HDR) | $(B)/sim
	$(CXX) $(SIM_CXXFLAGS) -x c++ -c $< -o $@

SIM_OBJS := $(B)/sim/cpar.o $(B)/sim/cpar_kernels.o

# ---- tests -----------------------------------------------------------------
$(B)/host/test_%: tests/test_%.c $(B)/host/cpar.o tests/testutil.h tests/proc.h | $(B)/host
	$(CC) $(ALL_CFLAGS) $(CHECK_FLAGS) $< $(B)/host/cpar.o -o $@ $(CHECK_LIBS) $(LIBS)

$(B)/host/store_prog: tests/store_prog.c $(B)/host/cpar.o | $(B)/host
	$(CC) $(ALL_CFLAGS) $< $(B)/host/cpar.o -o $@ $(LIBS)

$(B)/sim/test_%.o: tests/test_%.c tests/testutil.h tests/proc.h $(HDR) | $(B)/sim
	$(CC) $(ALL_CFLAGS) $(CHECK_FLAGS) -c $< -o $@

$(B)/sim/test_%: $(B)/sim/test_%.o $(SIM_OBJS)
	$(CXX) $^ -o $@ $(CHECK_LIBS) $(LIBS)

# Programs linked against the sim build: make test runs them with every
# kernel (flash attention, RMSNorm, GeLU, ...) on the CPU. lm_check trains a
# small LM on a synthetic language and checks tp x cp against 1 rank; train
# is the main job (examples/train.c).
$(B)/sim/lm_check.o: tests/lm_check.c $(HDR) | $(B)/sim
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(B)/sim/train.o: examples/train.c $(HDR) | $(B)/sim
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(B)/sim/lm_check $(B)/sim/train: $(B)/sim/%: $(B)/sim/%.o $(SIM_OBJS)
	$(CXX) $^ -o $@ $(LIBS)

$(B)/host/lm_check: tests/lm_check.c $(B)/host/cpar.o | $(B)/host
	$(CC) $(ALL_CFLAGS) $< $(B)/host/cpar.o -o $@ $(LIBS)

# Suites written in the CUDA dialect run only on the simulator.
$(B)/sim/test_cudasim: tests/test_cudasim.cu tests/cudasim.h | $(B)/sim
	$(CXX) $(SIM_CXXFLAGS) $(CHECK_FLAGS) -x c++ $< -o $@ $(CHECK_LIBS) $(LIBS)

$(B)/sim/test_devlayer: tests/test_devlayer.cu $(B)/sim/cpar_kernels.o tests/cudasim.h $(HDR) | $(B)/sim
	$(CXX) $(SIM_CXXFLAGS) $(CHECK_FLAGS) -x c++ $< -x none $(B)/sim/cpar_kernels.o -o $@ $(CHECK_LIBS) $(LIBS)

# The tensor-core wrappers and the attention kernels' internals are static
# device functions: these suites include cpar_kernels.cu themselves and link
# nothing else from cpar.
$(B)/sim/test_mma $(B)/sim/test_attn_bwd: $(B)/sim/test_%: tests/test_%.cu cpar_kernels.cu tests/cudasim.h $(HDR) | $(B)/sim
	$(CXX) $(SIM_CXXFLAGS) $(CHECK_FLAGS) -x c++ $< -o $@ $(CHECK_LIBS) $(LIBS)

# ---- nccl-sim build ----------------------------------------------------------
# cpar.c with the CUDA build's flags; tests/ncclsim/nccl.h comes first on the
# include path, so <nccl.h> is the simulator's. The kernels are the sim build's.
NCCLSIM_INC  := -Itests/ncclsim
NCCLSIM_LIB  := $(B)/ncclsim/ncclsim.o $(B)/ncclsim/ncclsim_cudasim.o
NCCLSIM_OBJS := $(B)/ncclsim/cpar.o $(B)/sim/cpar_kernels.o $(NCCLSIM_LIB)
NCCLSIM_HDRS := tests/ncclsim/nccl.h tests/ncclsim/ncclsim_hooks.h

$(B)/ncclsim/cpar.o: cpar.c $(HDR) $(NCCLSIM_HDRS) | $(B)/ncclsim
	$(CC) $(ALL_CFLAGS) -DCPAR_WITH_DEVICE -DCPAR_WITH_NCCL $(NCCLSIM_INC) -c $< -o $@

$(B)/ncclsim/ncclsim.o: tests/ncclsim/ncclsim.c $(NCCLSIM_HDRS) | $(B)/ncclsim
	$(CC) $(ALL_CFLAGS) $(NCCLSIM_INC) -c $< -o $@

$(B)/ncclsim/ncclsim_cudasim.o: tests/ncclsim/ncclsim_cudasim.cc $(NCCLSIM_HDRS) tests/cudasim.h | $(B)/ncclsim
	$(CXX) $(SIM_CXXFLAGS) $(NCCLSIM_INC) -x c++ -c $< -o $@

# The same test objects as the sim build, linked with the production path.
$(B)/ncclsim/test_%: $(B)/sim/test_%.o $(NCCLSIM_OBJS)
	$(CXX) $^ -o $@ $(CHECK_LIBS) $(LIBS)

$(B)/ncclsim/test_ncclsim: tests/test_ncclsim.cu $(NCCLSIM_LIB) $(NCCLSIM_HDRS) tests/cudasim.h | $(B)/ncclsim
	$(CXX) $(SIM_CXXFLAGS) $(NCCLSIM_INC) $(CHECK_FLAGS) -x c++ $< -x none $(NCCLSIM_LIB) -o $@ $(CHECK_LIBS) $(LIBS)

$(B)/ncclsim/mp_prog: $(B)/sim/mp_prog.o $(NCCLSIM_OBJS)
	$(CXX) $^ -o $@ $(LIBS)

$(B)/sim/mp_prog.o: tests/mp_prog.c tests/testutil.h $(HDR) | $(B)/sim
	$(CC) $(ALL_CFLAGS) $(CHECK_FLAGS) -c $< -o $@

$(B)/ncclsim/lm_check $(B)/ncclsim/train: $(B)/ncclsim/%: $(B)/sim/%.o $(NCCLSIM_OBJS)
	$(CXX) $^ -o $@ $(LIBS)

$(B)/cuda/test_gpu: tests/test_gpu.c $(B)/libcpar.a tests/testutil.h | $(B)/cuda
	$(CC) $(ALL_CFLAGS) $(CHECK_FLAGS) $< $(B)/libcpar.a -o $@ $(CHECK_LIBS) $(CUDA_LIBS) $(LIBS) -lstdc++

# The programs each flavour's suites need besides the test binaries.
HOST_PROGS    := $(TEST_PROGS) $(B)/cparrun $(B)/host/lm_check $(B)/train
SIM_PROGS     := $(B)/sim/lm_check $(B)/sim/train
NCCLSIM_PROGS := $(B)/cparrun $(B)/ncclsim/lm_check $(B)/ncclsim/train
HOST_PROGS    += $(B)/host/bench # tests/run.sh checks its --csv and --json output

RUN_TESTS = B=$(B) HOST_SUITES="$(1)" SIM_SUITES="$(2)" NCCLSIM_SUITES="$(3)" GPU_TEST="$(4)" sh tests/run.sh

test: $(HOST_TESTS) $(SIM_TESTS) $(NCCLSIM_TESTS) $(GPU_TEST) $(HOST_PROGS) $(SIM_PROGS) $(NCCLSIM_PROGS)
	@$(call RUN_TESTS,$(HOST_SUITES),$(SIM_SUITES),$(NCCLSIM_SUITES),$(GPU_TEST))

test-host: $(HOST_TESTS) $(HOST_PROGS)
	@$(call RUN_TESTS,$(HOST_SUITES),,,)

test-sim: $(SIM_TESTS) $(SIM_PROGS)
	@$(call RUN_TESTS,,$(SIM_SUITES),,)

test-ncclsim: $(NCCLSIM_TESTS) $(NCCLSIM_PROGS)
	@$(call RUN_TESTS,,,$(NCCLSIM_SUITES),)

test-gpu: $(GPU_TEST)
	@$(call RUN_TESTS,,,,$(GPU_TEST))

# ---- sanitizers --------------------------------------------------------------
# The host flavour under AddressSanitizer and UndefinedBehaviorSanitizer, in
# its own build directory; the first report ends the test (no recovery), so a
# suite passes only when it is clean. The fuzzer's batches run in forked
# processes and count such an ending as a crash.
SAN_FLAGS  := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
SAN_SUITES := core coll grid ops rng mappings xent linear attn ring mamba inference train fuzz
SAN_TESTS  := $(SAN_SUITES:%=$(B)/asan/test_%)
SAN_ENV    := ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1:abort_on_error=0 \
              UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

$(B)/asan/cpar.o: cpar.c $(HDR) | $(B)/asan
	$(CC) $(ALL_CFLAGS) $(SAN_FLAGS) -c $< -o $@

$(B)/asan/test_%: tests/test_%.c $(B)/asan/cpar.o tests/testutil.h tests/proc.h | $(B)/asan
	$(CC) $(ALL_CFLAGS) $(SAN_FLAGS) $(CHECK_FLAGS) $< $(B)/asan/cpar.o -o $@ $(CHECK_LIBS) $(LIBS)

test-sanitize: $(SAN_TESTS)
	@$(SAN_ENV) HOST_FLAVOUR=asan $(call RUN_TESTS,$(SAN_SUITES),,,)

# ---- demo and bench ----------------------------------------------------------
$(B)/train: examples/train.c $(B)/libcpar.a
	$(CC) $(ALL_CFLAGS) $< $(B)/libcpar.a -o $@ $(LIB_LIBS)

# The main job with its defaults (run from the repository's root: it trains
# on README.md, cpar.h and cpar.c). build/train --help lists the flags.
demo: $(B)/train
	./$(B)/train

$(B)/collectives: examples/collectives.c $(B)/libcpar.a
	$(CC) $(ALL_CFLAGS) $< $(B)/libcpar.a -o $@ $(LIB_LIBS)

collectives: $(B)/collectives
	./$(B)/collectives

$(B)/bench: bench/bench.c $(B)/libcpar.a
	$(CC) $(ALL_CFLAGS) $(BENCH_BLAS) $< $(B)/libcpar.a -o $@ $(LIB_LIBS) $(if $(BLAS_LIBS),,$(BENCH_BLAS_LIBS))

bench: $(B)/bench
	./$(B)/bench

# The host flavour of the bench, for tests/run.sh's check of --csv/--json.
$(B)/host/bench: bench/bench.c $(B)/host/cpar.o | $(B)/host
	$(CC) $(ALL_CFLAGS) $(BENCH_BLAS) $< $(B)/host/cpar.o -o $@ $(LIBS) $(if $(BLAS_LIBS),,$(BENCH_BLAS_LIBS))

# Bus bandwidth against message size, one PNG per collective, from a sweep
# (gnuplot, or python3 with matplotlib; tools/plot_bench.sh says which is missing).
PLOT_SWEEP ?= -b 8K -e 64M -f 2
plots: $(B)/bench
	./$(B)/bench $(PLOT_SWEEP) --csv $(B)/bench.csv --json $(B)/bench.json
	sh tools/plot_bench.sh $(B)/bench.csv $(B)/plots

clean:
	rm -rf $(B)
