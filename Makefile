# SPDX-License-Identifier: MIT
# cpar — build, test, bench, demo, install.
#
#   make              build/<mode>/libcpar.a, build/cparrun and build/train (CUDA + NCCL when found)
#   make test         host (and portable: plain C), sim and nccl-sim suites, the GPU suite when a GPU is present,
#                     the drop-in and install checks
#   make test-sanitize  the host suites under ASan + UBSan (build/asan)
#   make test-tsan    the threaded host suites and the main job under ThreadSanitizer (build/tsan)
#   make test-build   build all that make test, test-sanitize and test-tsan run, run nothing
#                     (the suites run CPAR_TEST_JOBS at a time, default: the number of cores)
#   make demo         the main job (examples/train.c): train a byte-level GPT with tp x cp (x dp)
#   make collectives  a tour of the raw collectives on a tp x cp grid (examples/collectives.c)
#   make bench        benchmarks (bench/)
#   make gpu-check    the one-shot check of a GPU machine (tools/gpu_check.sh; --prepare and --rehearse there)
#   make check-dropin  build the README's copy-three-files command lines in a temporary directory
#   make check-install make install into a temporary DESTDIR, then build a program with pkg-config
#   make install      PREFIX=/usr/local DESTDIR= SHARED=1 (also libcpar.so); make uninstall
#   make CPAR_CUDA=0  force a host-only build; CUDA_ARCH="90" for one GPU architecture
#
# Outputs go to build/, one directory per flavour, each with its own objects
# and libcpar.a, so switching modes never links another mode's library:
# build/cuda (nvcc + NCCL), build/host (host-only objects, programs and
# suites), build/sim (the CUDA simulator build: cpar_kernels.cu compiled by
# g++ with tests/cudasim.h), build/ncclsim (cpar.c compiled exactly as for
# GPUs, linked with the sim kernels and the NCCL simulator of tests/ncclsim).
# build/obj holds the objects of the suites and programs that see cpar only
# through cpar.h, compiled once and linked into every flavour.
# build/train, build/collectives and build/bench are links to the programs of
# the mode this make picked. Each CUDA object is compiled once.

CC       ?= cc
comma := ,
CXX      ?= g++
CUDA_HOME ?= /usr/local/cuda
NVCC     ?= $(CUDA_HOME)/bin/nvcc

# The version, from cpar.h (the shared library's name and cpar.pc).
cpar_version_part = $(shell sed -n 's/^[#]define CPAR_VERSION_$(1) *\([0-9][0-9]*\).*/\1/p' cpar.h)
VERSION_MAJOR := $(call cpar_version_part,MAJOR)
VERSION  := $(VERSION_MAJOR).$(call cpar_version_part,MINOR).$(call cpar_version_part,PATCH)

# NCCL and cuBLAS: with CUDA or in /usr, or where NCCL_HOME and CUBLAS_HOME
# say (DIR/include and DIR/lib, as in NCCL's tarball or the pip wheels:
# nvidia-nccl-cu13's nvidia/nccl, nvidia-cublas's nvidia/cu13). A library
# there without its unversioned link (the wheels ship libnccl.so.2 and
# libcublas.so.13 alone) is linked by its soname.
ifdef NCCL_HOME
  NCCL_INC := $(wildcard $(NCCL_HOME)/include/nccl.h)
  ifeq ($(NCCL_INC),)
    $(error cpar: NCCL_HOME=$(NCCL_HOME) has no include/nccl.h)
  endif
  NCCL_LIBDIR := $(NCCL_HOME)/lib
else
  NCCL_INC := $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h /usr/local/include/nccl.h))
  NCCL_LIBDIR := $(patsubst %/,%,$(dir $(firstword $(wildcard $(CUDA_HOME)/lib64/libnccl.so $(CUDA_HOME)/lib/libnccl.so \
                   /usr/lib/x86_64-linux-gnu/libnccl.so /usr/lib/aarch64-linux-gnu/libnccl.so /usr/local/lib/libnccl.so))))
  NCCL_LIBDIR := $(filter-out $(CUDA_HOME)/lib64 /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu,$(NCCL_LIBDIR))
endif
CUBLAS_LIBDIR := $(if $(CUBLAS_HOME),$(CUBLAS_HOME)/lib)
# -lNAME, or -l:libNAME.so.SOVER when DIR has only the versioned file.
cpar_lib_flag = $(if $(and $(2),$(wildcard $(2)/lib$(1).so.*),$(if $(wildcard $(2)/lib$(1).so),,1)),-l:$(notdir \
                  $(firstword $(wildcard $(2)/lib$(1).so.*))),-l$(1))
DEV_INCS := $(if $(NCCL_HOME),-isystem $(NCCL_HOME)/include) $(if $(CUBLAS_HOME),-isystem $(CUBLAS_HOME)/include)

# make demo builds only what it runs: with no GPU visible it runs on the host
# backend, so it builds the host mode and never calls nvcc; with one, the
# CUDA mode for the local GPUs (below). CPAR_CUDA on the command line wins.
GPU_QUERY = { nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || \
              $(CUDA_HOME)/bin/__nvcc_device_query 2>/dev/null; } | tr -d . | tr ', ' '\n\n' | grep -E '^[0-9]+$$' | sort -un
ifeq ($(MAKECMDGOALS)$(origin CPAR_CUDA),demoundefined)
  ifeq ($(strip $(shell $(GPU_QUERY))),)
    CPAR_CUDA := 0
    CUDA_WHY  := no GPU visible: make demo runs on the host backend and compiles no CUDA code
  endif
endif

# CUDA is used when nvcc and nccl.h are both found (override with CPAR_CUDA=0/1).
CUDA_WHY ?= CPAR_CUDA=$(CPAR_CUDA)
ifeq ($(origin CPAR_CUDA),undefined)
  CPAR_CUDA := $(if $(and $(wildcard $(NVCC)),$(NCCL_INC)),1,0)
  CUDA_WHY  := $(if $(wildcard $(NVCC)),$(if $(NCCL_INC),,nccl.h not found in $(CUDA_HOME)/include$(comma) /usr/include or /usr/local/include; set NCCL_HOME),nvcc not found at $(NVCC); set CUDA_HOME)
endif
# A CUDA build that was asked for and cannot find NCCL stops here, loudly,
# rather than building something else.
ifeq ($(CPAR_CUDA)$(NCCL_INC),1)
  $(error cpar: CPAR_CUDA=1 but nccl.h is not in $(CUDA_HOME)/include$(comma) /usr/include or /usr/local/include: set NCCL_HOME=DIR (DIR/include/nccl.h$(comma) DIR/lib/libnccl.so*))
endif

# GPU architectures (CUDA builds only). The kernels need sm_80 or newer
# (mma.sync on bf16, cp.async). By default: the local GPUs when there are any
# (nvidia-smi, else nvcc's __nvcc_device_query); otherwise one cubin per
# generation from sm_80 on that this nvcc knows (a cubin runs on every GPU of
# its major version with an equal or higher minor: sm_80 covers sm_86/sm_89).
# Either way the newest one is also embedded as PTX, which the driver compiles
# for GPUs newer than this nvcc. CUDA_ARCH="90" (or "80 90") overrides.
ifeq ($(CPAR_CUDA),1)
  NVCC_CODES := $(filter-out 1 2 3% 4% 5% 6% 7%,$(shell $(NVCC) --list-gpu-code 2>/dev/null | sed -n 's/^sm_\([0-9][0-9]*\)$$/\1/p'))
  ifeq ($(origin CUDA_ARCH),undefined)
    LOCAL_ARCH := $(filter $(NVCC_CODES),$(shell $(GPU_QUERY)))
    FAT_ARCH   := $(shell for c in $(NVCC_CODES); do echo $$c; done | \
                    awk '{ m = int($$1 / 10); if (!(m in b) || $$1 < b[m]) b[m] = $$1 } END { for (m in b) print b[m] }' | sort -n)
    CUDA_ARCH  := $(or $(LOCAL_ARCH),$(FAT_ARCH),80 90)
    ARCH_WHY   := $(if $(LOCAL_ARCH),kernels for the local GPU:,no GPU here$(comma) so kernels for)
  else
    ARCH_WHY   := kernels for CUDA_ARCH:
  endif
  PTX_ARCH := $(lastword $(shell for a in $(CUDA_ARCH); do echo $$a; done | sort -n))
  NVCC_VERSION := $(shell $(NVCC) --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
  NCCL_VERSION := $(if $(NCCL_INC),$(shell sed -n 's/^[#]define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9][0-9]*\).*/\2/p' $(NCCL_INC) | paste -sd.))
  CPAR_BANNER   = cpar: CUDA build in $(B)/cuda (nvcc $(NVCC_VERSION)$(comma) NCCL $(NCCL_VERSION) found; \
                  $(ARCH_WHY) $(CUDA_ARCH:%=sm_%) + PTX compute_$(PTX_ARCH))
else
  CPAR_BANNER   = cpar: host build in $(B)/host ($(CUDA_WHY))
endif

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
# --threads 0: nvcc compiles the architectures in parallel.
NVCCFLAGS ?= -O3 -std=c++17 $(foreach a,$(CUDA_ARCH),-gencode arch=compute_$(a),code=sm_$(a)) \
             -gencode arch=compute_$(PTX_ARCH),code=compute_$(PTX_ARCH) --threads 0 -Xcompiler -Wall,-Wextra -I.
# The suites need Check. Missing: as root with apt-get, say so and install it
# (a fresh Debian/Ubuntu machine); otherwise stop before building anything,
# with the command to run.
TEST_GOALS := test test-host test-sim test-ncclsim test-gpu test-sanitize test-tsan test-build
cpar_check_found = $(shell pkg-config --exists check 2>/dev/null && echo 1 || \
                     { printf '\043include <check.h>\n' | $(CC) -E -x c - >/dev/null 2>&1 && echo 1; })
ifneq ($(filter $(TEST_GOALS),$(MAKECMDGOALS)),)
  CHECK_FOUND := $(cpar_check_found)
  ifneq ($(CHECK_FOUND),1)
    ifeq ($(shell id -u)$(if $(shell command -v apt-get 2>/dev/null),apt),0apt)
      $(info cpar: the test suites need the Check framework; installing it: apt-get install -y check pkg-config)
      CPAR_APT := $(shell { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq check \
                            pkg-config; } >&2 && echo ok)
      CHECK_FOUND := $(cpar_check_found)
    endif
  endif
  ifneq ($(CHECK_FOUND),1)
    $(error cpar: the test suites need the Check framework (check.h not found); install it with: $(if $(filter 0,$(shell id -u)),,sudo )apt-get install -y check pkg-config)
  endif
endif
CHECK_FLAGS := $(shell pkg-config --cflags check 2>/dev/null)
CHECK_LIBS  := $(shell pkg-config --libs check 2>/dev/null || echo -lcheck -lsubunit -lrt -lm -pthread)
CUDA_LIBS   := $(foreach d,$(NCCL_LIBDIR) $(CUBLAS_LIBDIR),-L$(d)) -L$(CUDA_HOME)/lib64 \
               $(call cpar_lib_flag,nccl,$(NCCL_LIBDIR)) $(call cpar_lib_flag,cublas,$(CUBLAS_LIBDIR)) -lcudart \
               $(foreach d,$(NCCL_LIBDIR) $(CUBLAS_LIBDIR) $(CUDA_HOME)/lib64,-Wl$(comma)-rpath$(comma)$(d))
# -lrt: shm_open (the process-mode host backend) lives in librt before glibc 2.34.
LIBS        := -pthread -lm -lrt $(BLAS_LIBS)

B := build

# The mode's directory M holds its library and programs.
ifeq ($(CPAR_CUDA),1)
  MODE      := cuda
  LIB_LIBS  := $(CUDA_LIBS) $(LIBS) -lstdc++
else
  MODE      := host
  LIB_LIBS  := $(LIBS)
endif
M        := $(B)/$(MODE)
LIB      := $(M)/libcpar.a
LIB_OBJS := $(M)/cpar.o $(if $(filter 1,$(CPAR_CUDA)),$(M)/cpar_kernels.o)
SOLIB    := $(M)/libcpar.so.$(VERSION)
SO_OBJS  := $(M)/pic/cpar.o $(if $(filter 1,$(CPAR_CUDA)),$(M)/cpar_kernels.o)
SHARED   ?= 0

# One line saying which mode this make picked and why, once per command
# (not in the sub-makes of make check-install, nor for clean).
ifeq ($(MAKELEVEL),0)
  ifneq ($(filter-out clean uninstall,$(or $(MAKECMDGOALS),all)),)
    $(info $(CPAR_BANNER))
  endif
endif


# Suites that take a backend run on host, sim and nccl-sim; the rest are
# host-only (processes, sockets) or sim-only (the simulator and the device layer).
BACKEND_SUITES := core coll grid faults ops rng mappings xent linear attn ring packed mamba inference train
HOST_SUITES    := $(BACKEND_SUITES) store cparrun trainjob fuzz hostmp
SIM_SUITES     := $(BACKEND_SUITES) cudasim devlayer mma attn_bwd trainjob
# nccl-sim runs every backend suite on CPAR_BACKEND_NCCL, the simulator's own
# suite, the GPU suite's bodies, and multi-process jobs under cparrun.
NCCLSIM_SUITES := $(BACKEND_SUITES) ncclsim gpu mp trainjob
HOST_TESTS := $(HOST_SUITES:%=$(B)/host/test_%)
SIM_TESTS  := $(SIM_SUITES:%=$(B)/sim/test_%)
NCCLSIM_TESTS := $(NCCLSIM_SUITES:%=$(B)/ncclsim/test_%) $(B)/ncclsim/mp_prog
GPU_TEST   := $(if $(filter 1,$(CPAR_CUDA)),$(B)/cuda/test_gpu)
TEST_PROGS := $(B)/host/store_prog

.PHONY: all lib test test-quick test-host test-sim test-ncclsim test-gpu test-sanitize test-tsan test-build demo collectives bench plots plots-run clean gpu-check \
        install uninstall check-dropin check-install FORCE
.SECONDARY: # keep the test objects that several flavours link
all: lib $(B)/cparrun $(B)/train $(B)/bench
lib: $(LIB) $(if $(filter 1,$(SHARED)),$(SOLIB))

$(B)/host $(B)/sim $(B)/ncclsim $(B)/cuda $(B)/asan $(B)/tsan $(B)/portable $(M)/pic:
	@mkdir -p $@

# ---- library -------------------------------------------------------------
HDR := cpar.h

# Each library directory records the flags its objects were built with, so
# changing CUDA_ARCH, CFLAGS or CPAR_BLAS rebuilds them instead of linking
# objects built another way.
$(B)/host/flags $(B)/cuda/flags $(B)/obj/flags: FORCE
	@mkdir -p $(@D)
	@echo '$(CC) $(ALL_CFLAGS) $(if $(filter $(B)/cuda/%,$@),$(NVCC) $(NVCCFLAGS) $(DEV_INCS))' | cmp -s - $@ || \
	    echo '$(CC) $(ALL_CFLAGS) $(if $(filter $(B)/cuda/%,$@),$(NVCC) $(NVCCFLAGS) $(DEV_INCS))' > $@

$(B)/host/cpar.o $(B)/host/pic/cpar.o: cpar.c $(HDR) $(B)/host/flags
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) $(if $(filter %/pic/cpar.o,$@),-fPIC) -c $< -o $@

$(B)/cuda/cpar.o $(B)/cuda/pic/cpar.o: cpar.c $(HDR) $(B)/cuda/flags
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -DCPAR_WITH_DEVICE -DCPAR_WITH_NCCL $(DEV_INCS) -isystem $(CUDA_HOME)/include \
	    $(if $(filter %/pic/cpar.o,$@),-fPIC) -c $< -o $@

# Position-independent, so libcpar.so reuses it: nvcc is slow, and the
# kernels' host code is launch wrappers that -fPIC does not slow down.
$(B)/cuda/cpar_kernels.o: cpar_kernels.cu $(HDR) $(B)/cuda/flags
	$(NVCC) $(NVCCFLAGS) $(DEV_INCS) -Xcompiler -fPIC -c $< -o $@

$(LIB): $(LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

# The shared library (SHARED=1): cpar.c again as position-independent code
# in $(M)/pic, with the kernels' object; the soname changes with the major
# version.
$(SOLIB): $(SO_OBJS)
	$(CC) -shared -Wl,-soname,libcpar.so.$(VERSION_MAJOR) $^ -o $@ $(LIB_LIBS)

$(B)/cparrun: bootstrap/cparrun.c | $(B)/host
	$(CC) $(ALL_CFLAGS) $< -o $@

# ---- portable build --------------------------------------------------------
# cpar.c as plain C (-DCPAR_PORTABLE: no intrinsics, no AVX2 twins, no CBLAS),
# which is what a CPU without AVX2+FMA, or another architecture, runs. make
# test runs the suites of the host kernels that have an x86 path on it, so
# their plain paths run too: the GEMM's portable micro-kernel, the twins'
# baselines, libm's expf in attention, memcpy for streaming stores.
PORTABLE_SUITES := ops xent linear attn inference mamba coll train
PORTABLE_TESTS  := $(PORTABLE_SUITES:%=$(B)/portable/test_%)

$(B)/portable/cpar.o: cpar.c $(HDR) $(B)/obj/flags | $(B)/portable
	$(CC) -std=c11 $(WARN) $(CFLAGS) -pthread -I. -DCPAR_PORTABLE -c $< -o $@

$(B)/portable/test_%: $(B)/obj/test_%.o $(B)/portable/cpar.o
	$(CC) $^ -o $@ $(CHECK_LIBS) -pthread -lm -lrt

# ---- sim build -------------------------------------------------------------
# Position-independent, so they also make build/sim/libcpar_sim.so: the sim
# build as a shared library, which tools/gpu_check.sh --rehearse loads into
# Python (tools/gpu_bench.py) as the GPU check loads the CUDA build's.
$(B)/sim/cpar.o: cpar.c $(HDR) | $(B)/sim
	$(CC) $(ALL_CFLAGS) -fPIC -DCPAR_WITH_DEVICE -DCPAR_SIM -c $< -o $@

$(B)/sim/cpar_kernels.o: cpar_kernels.cu tests/cudasim.h $(HDR) | $(B)/sim
	$(CXX) $(SIM_CXXFLAGS) -fPIC -x c++ -c $< -o $@

SIM_OBJS := $(B)/sim/cpar.o $(B)/sim/cpar_kernels.o

$(B)/sim/libcpar_sim.so: $(SIM_OBJS)
	$(CXX) -shared $^ -o $@ $(LIBS)

# ---- tests -----------------------------------------------------------------
# The headers the C suites share (tests/suite.h also serves the C++ ones).
TEST_HDRS := tests/testutil.h tests/suite.h tests/proc.h tests/net.h tests/packed.h

# The suites and programs in C see cpar only through cpar.h, which reads no
# build flag: each is compiled once, into $(B)/obj, and linked with every
# flavour's library (host, sim, nccl-sim, CUDA). Only the sanitizer build
# compiles them again, with its own flags.
$(B)/obj/%.o: tests/%.c tests/rank_prog.h $(TEST_HDRS) $(HDR) $(B)/obj/flags
	$(CC) $(ALL_CFLAGS) $(CHECK_FLAGS) -c $< -o $@

$(B)/obj/train.o: examples/train.c $(HDR) $(B)/obj/flags
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(B)/obj/bench.o: bench/bench.c $(HDR) $(B)/obj/flags
	$(CC) $(ALL_CFLAGS) $(BENCH_BLAS) -c $< -o $@

$(B)/host/test_%: $(B)/obj/test_%.o $(B)/host/cpar.o | $(B)/host
	$(CC) $^ -o $@ $(CHECK_LIBS) $(LIBS)

# The ranks of test_hostmp's multi-process jobs on the host backend (mp_prog
# is the nccl-sim suite's program, here with CPAR_BACKEND=host), test_cparrun's
# store_prog, and lm_check (below).
$(B)/host/store_prog $(B)/host/hostmp_prog $(B)/host/mp_prog $(B)/host/lm_check: $(B)/host/%: $(B)/obj/%.o \
        $(B)/host/cpar.o | $(B)/host
	$(CC) $^ -o $@ $(LIBS)

$(B)/sim/test_%: $(B)/obj/test_%.o $(SIM_OBJS)
	$(CXX) $^ -o $@ $(CHECK_LIBS) $(LIBS)

# Programs linked against the sim build: make test runs them with every
# kernel (flash attention, RMSNorm, GeLU, ...) on the CPU. lm_check trains a
# small LM on a synthetic language and checks tp x cp against 1 rank; train
# is the main job (examples/train.c).
$(B)/sim/lm_check $(B)/sim/train: $(B)/sim/%: $(B)/obj/%.o $(SIM_OBJS)
	$(CXX) $^ -o $@ $(LIBS)

# Suites written in the CUDA dialect run only on the simulator.
$(B)/sim/test_cudasim: tests/test_cudasim.cu tests/cudasim.h tests/suite.h | $(B)/sim
	$(CXX) $(SIM_CXXFLAGS) $(CHECK_FLAGS) -x c++ $< -o $@ $(CHECK_LIBS) $(LIBS)

$(B)/sim/test_devlayer: tests/test_devlayer.cu $(B)/sim/cpar_kernels.o tests/cudasim.h tests/suite.h $(HDR) | $(B)/sim
	$(CXX) $(SIM_CXXFLAGS) $(CHECK_FLAGS) -x c++ $< -x none $(B)/sim/cpar_kernels.o -o $@ $(CHECK_LIBS) $(LIBS)

# The tensor-core wrappers and the attention kernels' internals are static
# device functions: these suites include cpar_kernels.cu themselves and link
# nothing else from cpar.
$(B)/sim/test_mma $(B)/sim/test_attn_bwd: $(B)/sim/test_%: tests/test_%.cu cpar_kernels.cu tests/cudasim.h tests/suite.h $(HDR) | $(B)/sim
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

# The same test objects as the other flavours, linked with the production path.
$(B)/ncclsim/test_%: $(B)/obj/test_%.o $(NCCLSIM_OBJS)
	$(CXX) $^ -o $@ $(CHECK_LIBS) $(LIBS)

$(B)/ncclsim/test_ncclsim: tests/test_ncclsim.cu $(NCCLSIM_LIB) $(NCCLSIM_HDRS) tests/cudasim.h tests/suite.h | $(B)/ncclsim
	$(CXX) $(SIM_CXXFLAGS) $(NCCLSIM_INC) $(CHECK_FLAGS) -x c++ $< -x none $(NCCLSIM_LIB) -o $@ $(CHECK_LIBS) $(LIBS)

$(B)/ncclsim/mp_prog $(B)/ncclsim/lm_check $(B)/ncclsim/train $(B)/ncclsim/bench: $(B)/ncclsim/%: $(B)/obj/%.o $(NCCLSIM_OBJS)
	$(CXX) $^ -o $@ $(LIBS)

$(B)/cuda/test_gpu: $(B)/obj/test_gpu.o $(B)/cuda/libcpar.a | $(B)/cuda
	$(CC) $^ -o $@ $(CHECK_LIBS) $(CUDA_LIBS) $(LIBS) -lstdc++

# A backend suite against the GPU library: tools/gpu_check.sh runs the
# multi-rank ones on the device backend (CPAR_TEST_BACKEND=device), so one
# GPU checks ring attention, the linear layers' overlap, Mamba CP and training.
$(B)/cuda/test_%: $(B)/obj/test_%.o $(B)/cuda/libcpar.a | $(B)/cuda
	$(CC) $^ -o $@ $(CHECK_LIBS) $(CUDA_LIBS) $(LIBS) -lstdc++

# The programs each flavour's suites need besides the test binaries.
HOST_PROGS    := $(TEST_PROGS) $(B)/cparrun $(B)/host/lm_check $(B)/train
SIM_PROGS     := $(B)/sim/lm_check $(B)/sim/train $(B)/sim/libcpar_sim.so $(B)/train # test_trainjob: device vs host
NCCLSIM_PROGS := $(B)/cparrun $(B)/ncclsim/lm_check $(B)/ncclsim/train $(B)/ncclsim/bench # bench: the device rows
HOST_PROGS    += $(B)/host/bench # tests/run.sh checks its --csv and --json output
HOST_PROGS    += $(B)/host/hostmp_prog $(B)/host/mp_prog $(B)/host/train # test_hostmp's jobs

RUN_TESTS = B=$(B) HOST_SUITES="$(1)" SIM_SUITES="$(2)" NCCLSIM_SUITES="$(3)" GPU_TEST="$(4)" PKG_CHECKS="$(5)" \
            PORTABLE_SUITES="$(6)" sh tests/run.sh

# The drop-in and install checks (scripts that build programs the ways the
# README tells users to) run after the suites; PKG_ENV is what they need.
PKG_ENV = MAKE="$(MAKE)" CC="$(CC)" CUDA_HOME="$(CUDA_HOME)" CPAR_CUDA=$(CPAR_CUDA) CPAR_MODE=$(MODE) \
          DROPIN_ARCH="$(PTX_ARCH)" DROPIN_KERNELS="$(abspath $(DROPIN_KERNELS))"
# The drop-in check's stand-in for its nvcc pass (tests/check_dropin.sh):
# the CUDA build's kernels, compiled for PTX_ARCH among others.
DROPIN_KERNELS := $(if $(filter 1,$(CPAR_CUDA)),$(B)/cuda/cpar_kernels.o)

TEST_DEPS := $(HOST_TESTS) $(PORTABLE_TESTS) $(SIM_TESTS) $(NCCLSIM_TESTS) $(GPU_TEST) $(HOST_PROGS) $(SIM_PROGS) \
             $(NCCLSIM_PROGS) $(DROPIN_KERNELS)
test: $(TEST_DEPS)
	+@$(PKG_ENV) $(call RUN_TESTS,$(HOST_SUITES),$(SIM_SUITES),$(NCCLSIM_SUITES),$(GPU_TEST),dropin install,$(PORTABLE_SUITES))

# A first check in about a minute: the backend suites on the host backend.
test-quick: $(BACKEND_SUITES:%=$(B)/host/test_%)
	@$(call RUN_TESTS,$(BACKEND_SUITES),,,)

test-host: $(HOST_TESTS) $(PORTABLE_TESTS) $(HOST_PROGS)
	@$(call RUN_TESTS,$(HOST_SUITES),,,,,$(PORTABLE_SUITES))

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
SAN_SUITES := core coll grid ops rng mappings xent linear attn ring packed mamba inference train fuzz
# The attention kernels too, on the simulator (test_attn_bwd includes
# cpar_kernels.cu; test_cudasim checks the poisoning below): under
# AddressSanitizer the simulator poisons the guard bytes around every
# cudaMalloc and the shared memory past a launch's size, so a kernel's
# out-of-bounds read or write is reported where it happens (what
# compute-sanitizer's memcheck does on a GPU), and UBSan reports a
# misaligned vector access, which faults on a GPU and passes on x86, and an
# index past a fixed-size (register) array. Only those two UBSan checks
# there: the rest (overflow, shifts, null) took the kernels' compile from
# 47 to 70 s and their run from 34 to 45 s, and the host suites keep them.
SAN_SIM_SUITES := cudasim attn_bwd
SAN_SIM_FLAGS  := -fsanitize=address,alignment,bounds -fno-omit-frame-pointer -fno-sanitize-recover=all
SAN_TESTS  := $(SAN_SUITES:%=$(B)/asan/test_%) $(SAN_SIM_SUITES:%=$(B)/asan/sim/test_%)
SAN_ENV    := ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1:abort_on_error=0 \
              UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

$(B)/asan/cpar.o: cpar.c $(HDR) | $(B)/asan
	$(CC) $(ALL_CFLAGS) $(SAN_FLAGS) -c $< -o $@

$(B)/asan/test_%: tests/test_%.c $(B)/asan/cpar.o $(TEST_HDRS) | $(B)/asan
	$(CC) $(ALL_CFLAGS) $(SAN_FLAGS) $(CHECK_FLAGS) $< $(B)/asan/cpar.o -o $@ $(CHECK_LIBS) $(LIBS)

$(SAN_SIM_SUITES:%=$(B)/asan/sim/test_%): $(B)/asan/sim/test_%: tests/test_%.cu cpar_kernels.cu tests/cudasim.h tests/suite.h $(HDR)
	@mkdir -p $(@D)
	$(CXX) $(SIM_CXXFLAGS) $(SAN_SIM_FLAGS) $(CHECK_FLAGS) -x c++ $< -o $@ $(CHECK_LIBS) $(LIBS)

test-sanitize: $(SAN_TESTS)
	@$(SAN_ENV) HOST_FLAVOUR=asan SAN_SIM_SUITES="$(SAN_SIM_SUITES)" CPAR_TEST_LOG=$(B)/test-sanitize.log \
	    $(call RUN_TESTS,$(SAN_SUITES),,,)

# The host flavour under ThreadSanitizer: the suites whose ranks are threads
# sharing one process, the store's server and the main job (its ranks check
# their checkpoint files at once). The first report ends the test
# (halt_on_error). Left out for time: linear (2.5 minutes; its forked
# children also start threads, which TSan refuses) and attn (1 minute), and
# coll's 16 MiB collectives (tag "large", 2 minutes).
# On nccl-sim too (the NCCL path's failure handling reads the job's state
# without its lock), the simulators instrumented with cpar: uninstrumented,
# their thread-safe statics read as races.
TSAN_FLAGS  := -fsanitize=thread -O1 # debug information as CFLAGS/CXXFLAGS say
TSAN_SUITES := faults core coll grid ops rng mappings xent packed ring mamba inference train store trainjob
TSAN_NCCL_SUITES := faults coll
TSAN_TESTS  := $(TSAN_SUITES:%=$(B)/tsan/test_%) $(B)/tsan/train $(TSAN_NCCL_SUITES:%=$(B)/tsan/ncclsim/test_%)
TSAN_ENV    := TSAN_OPTIONS=halt_on_error=1 TRAIN=$(B)/tsan/train CK_EXCLUDE_TAGS=large \
               TSAN_NCCL_SUITES="$(TSAN_NCCL_SUITES)"
TSAN_NCCL_OBJS := $(B)/tsan/ncclsim/cpar.o $(B)/tsan/ncclsim/cpar_kernels.o $(B)/tsan/ncclsim/ncclsim.o \
                  $(B)/tsan/ncclsim/ncclsim_cudasim.o

$(B)/tsan/cpar.o: cpar.c $(HDR) | $(B)/tsan
	$(CC) $(ALL_CFLAGS) $(TSAN_FLAGS) -c $< -o $@

$(B)/tsan/test_%: tests/test_%.c $(B)/tsan/cpar.o $(TEST_HDRS) | $(B)/tsan
	$(CC) $(ALL_CFLAGS) $(TSAN_FLAGS) $(CHECK_FLAGS) $< $(B)/tsan/cpar.o -o $@ $(CHECK_LIBS) $(LIBS)

$(B)/tsan/train: examples/train.c $(B)/tsan/cpar.o $(HDR) | $(B)/tsan
	$(CC) $(ALL_CFLAGS) $(TSAN_FLAGS) $< $(B)/tsan/cpar.o -o $@ $(LIBS)

$(B)/tsan/ncclsim/cpar.o: cpar.c $(HDR) $(NCCLSIM_HDRS)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) $(TSAN_FLAGS) -DCPAR_WITH_DEVICE -DCPAR_WITH_NCCL $(NCCLSIM_INC) -c $< -o $@

$(B)/tsan/ncclsim/cpar_kernels.o: cpar_kernels.cu tests/cudasim.h $(HDR)
	@mkdir -p $(@D)
	$(CXX) $(SIM_CXXFLAGS) $(TSAN_FLAGS) -x c++ -c $< -o $@

$(B)/tsan/ncclsim/ncclsim.o: tests/ncclsim/ncclsim.c $(NCCLSIM_HDRS)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) $(TSAN_FLAGS) $(NCCLSIM_INC) -c $< -o $@

$(B)/tsan/ncclsim/ncclsim_cudasim.o: tests/ncclsim/ncclsim_cudasim.cc $(NCCLSIM_HDRS) tests/cudasim.h
	@mkdir -p $(@D)
	$(CXX) $(SIM_CXXFLAGS) $(TSAN_FLAGS) $(NCCLSIM_INC) -x c++ -c $< -o $@

$(B)/tsan/ncclsim/test_%.o: tests/test_%.c tests/rank_prog.h $(TEST_HDRS) $(HDR)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) $(TSAN_FLAGS) $(CHECK_FLAGS) -c $< -o $@

$(B)/tsan/ncclsim/test_%: $(B)/tsan/ncclsim/test_%.o $(TSAN_NCCL_OBJS)
	$(CXX) $(TSAN_FLAGS) $^ -o $@ $(CHECK_LIBS) $(LIBS)

test-tsan: $(TSAN_TESTS)
	@$(TSAN_ENV) HOST_FLAVOUR=tsan CPAR_TEST_LOG=$(B)/test-tsan.log $(call RUN_TESTS,$(TSAN_SUITES),,,)

# Everything make test and make test-sanitize run, built but not run: one
# make -j over all of it keeps the cores busy while nvcc compiles the kernels.
# (The position-independent objects are those of make check-install's
# SHARED=1 install.)
test-build: $(TEST_DEPS) $(SAN_TESTS) $(TSAN_TESTS) $(SO_OBJS) $(B)/obj/gemm_vs_torch.o

# tools/gemm_vs_torch.sh's ctypes shim (the script, which needs torch, builds
# it again with cpar.c): compiled here so that it keeps up with cpar.h.
$(B)/obj/gemm_vs_torch.o: tools/gemm_vs_torch.c $(HDR) $(B)/obj/flags
	$(CC) $(ALL_CFLAGS) -fPIC -c $< -o $@

# ---- demo and bench ----------------------------------------------------------
# Each mode's programs live in its directory, linked with its library;
# build/train, build/collectives and build/bench point at this make's mode
# (re-pointed on every make, since the other mode's program may be newer).
$(M)/train: $(B)/obj/train.o $(LIB)
	$(CC) $^ -o $@ $(LIB_LIBS)

$(M)/collectives: examples/collectives.c $(LIB)
	$(CC) $(ALL_CFLAGS) $< $(LIB) -o $@ $(LIB_LIBS)

$(M)/bench: $(B)/obj/bench.o $(LIB)
	$(CC) $^ -o $@ $(LIB_LIBS) $(if $(BLAS_LIBS),,$(BENCH_BLAS_LIBS))

$(B)/train $(B)/collectives $(B)/bench: $(B)/%: $(M)/% FORCE
	@[ "$$(readlink $@)" = "$(MODE)/$*" ] || ln -sfn $(MODE)/$* $@

# The main job with its defaults (run from the repository's root: it trains
# on README.md, cpar.h and cpar.c). build/train --help lists the flags.
# DEMO_FLAGS: train's flags (./build/train --help), e.g. "--steps 200".
demo: $(B)/train
	./$(B)/train $(DEMO_FLAGS)

collectives: $(B)/collectives
	./$(B)/collectives

bench: $(B)/bench
	./$(B)/bench

# The one-shot check of a lent GPU machine (tools/gpu_check.sh: probe, a
# build for its GPU, the GPU suite, a short training run, the bench beside
# torch, a summary last); make test rehearses it on the simulator builds.
gpu-check:
	sh tools/gpu_check.sh

# The host flavour of the bench, for tests/run.sh's check of --csv/--json
# (in a host-mode make it is the mode's own bench, built above).
ifneq ($(MODE),host)
$(B)/host/bench: $(B)/obj/bench.o $(B)/host/cpar.o | $(B)/host
	$(CC) $^ -o $@ $(LIBS) $(if $(BLAS_LIBS),,$(BENCH_BLAS_LIBS))

# The main job on the host flavour, for test_hostmp's cparrun run of it.
$(B)/host/train: $(B)/obj/train.o $(B)/host/cpar.o | $(B)/host
	$(CC) $^ -o $@ $(LIBS)
endif

# Bus bandwidth against message size, one PNG per collective, from a sweep
# (gnuplot, or python3 with matplotlib; tools/plot_bench.sh says which is missing).
PLOT_SWEEP ?= -b 8K -e 64M -f 2
# The main job's loss curve from a short run (PLOT_STEPS steps, no sample).
PLOT_STEPS ?= 300
# The plotting tool is checked first, before anything is built or run.
plots:
	@sh tools/plot_bench.sh --check
	@$(MAKE) --no-print-directory plots-run
plots-run: $(B)/bench $(B)/train
	./$(B)/bench $(PLOT_SWEEP) --csv $(B)/bench.csv --json $(B)/bench.json
	sh tools/plot_bench.sh $(B)/bench.csv $(B)/plots
	./$(B)/train --steps $(PLOT_STEPS) --eval-every 50 --log-every 1 --sample 0 > $(B)/train.log
	sh tools/plot_loss.sh $(B)/train.log $(B)/plots/train_loss.png

# ---- drop-in, install ----------------------------------------------------------
# check-dropin: the README's command lines for the three copied files, in a
# temporary directory, host-only and (with nvcc and NCCL) CUDA; the CUDA
# program runs only where there is a GPU. Its nvcc line is checked by nvcc
# (options, preprocessing) and the CUDA build's cpar_kernels.o stands in for
# its output (CPAR_DROPIN_NVCC=1: it runs as written). check-install: make install into a
# temporary DESTDIR (static, then SHARED=1) and build tests/pkg_prog.c with
# pkg-config. make test runs both.
check-dropin: $(DROPIN_KERNELS)
	@$(PKG_ENV) sh tests/check_dropin.sh

check-install:
	+@$(PKG_ENV) sh tests/check_install.sh

PREFIX     ?= /usr/local
bindir     := $(PREFIX)/bin
includedir := $(PREFIX)/include
libdir     := $(PREFIX)/lib

# cpar.pc: the static library needs its dependencies on the link line; the
# shared one records them itself and finds its own directory by rpath.
PC_DEPS := $(filter-out -pthread,$(LIB_LIBS))
PC_LIBS := $(if $(filter 1,$(SHARED)),-L$${libdir} -Wl$(comma)-rpath$(comma)$${libdir} -lcpar,-L$${libdir} -lcpar $(PC_DEPS))

install: lib $(B)/cparrun
	install -d $(DESTDIR)$(includedir) $(DESTDIR)$(libdir)/pkgconfig $(DESTDIR)$(bindir)
	install -m 644 cpar.h $(DESTDIR)$(includedir)/cpar.h
	install -m 644 $(LIB) $(DESTDIR)$(libdir)/libcpar.a
	install -m 755 $(B)/cparrun $(DESTDIR)$(bindir)/cparrun
ifeq ($(SHARED),1)
	install -m 755 $(SOLIB) $(DESTDIR)$(libdir)/libcpar.so.$(VERSION)
	ln -sfn libcpar.so.$(VERSION) $(DESTDIR)$(libdir)/libcpar.so.$(VERSION_MAJOR)
	ln -sfn libcpar.so.$(VERSION_MAJOR) $(DESTDIR)$(libdir)/libcpar.so
endif
	printf '%s\n' 'prefix=$(PREFIX)' 'includedir=$${prefix}/include' 'libdir=$${prefix}/lib' '' \
	    'Name: cpar' 'Description: Megatron-style model parallelism in C ($(MODE) build)' 'Version: $(VERSION)' \
	    'Cflags: -I$${includedir}' 'Libs: $(PC_LIBS) -pthread' \
	    $(if $(filter 1,$(SHARED)),'Libs.private: $(PC_DEPS)') > $(DESTDIR)$(libdir)/pkgconfig/cpar.pc

uninstall:
	rm -f $(DESTDIR)$(includedir)/cpar.h $(DESTDIR)$(libdir)/libcpar.a $(DESTDIR)$(libdir)/libcpar.so* \
	    $(DESTDIR)$(bindir)/cparrun $(DESTDIR)$(libdir)/pkgconfig/cpar.pc

clean:
	rm -rf $(B)

FORCE:
