#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gpu_bench.py - cpar's kernels beside torch's, on the same GPU, shapes and data.

tools/gpu_check.sh runs it on a lent GPU (and, rehearsing, on the CUDA
simulator at small sizes). It loads a shared cpar (libcpar.so of the CUDA
build, or the sim build's libcpar_sim.so) through ctypes, makes a one-rank
context (cpar_init_from_env with no launcher variables), and for each case
uploads the same random inputs (drawn by torch on the CPU from a fixed seed)
to both sides, runs cpar and torch, compares the results (normwise relative
error ||cpar - torch|| / ||torch||) and times both:

  attn    flash attention forward and backward, bf16, against SDPA's flash
          and cudnn backends: TFLOP/s and cpar's time over each backend's
          (FA2's count: 4 b h s^2 d forward, half when causal; 2.5x that
          backward). Batch x heads fill the GPU as FA2's benchmark does:
          b = 16384 / s, h = 2048 / d.
  gemm    the linear layer's GEMMs (cpar_linear_forward / _backward, tp = 1)
          against torch.matmul on the same operands.
  xent    the vocabulary-parallel cross entropy (tp = 1) against
          F.cross_entropy, forward and backward.
  mem     RMSNorm, GeLU, casts and AdamW as bandwidth over a device-to-device
          copy's, measured in the same run (cpar_tensor_copy), with torch's
          own kernel on the same data beside it.

Timing: each side runs `iters` calls between two synchronisations of the
whole device (cpar_sync, then torch.cuda.synchronize, which waits for every
stream, cpar's too), five times after warm-up; the median of the five means.
Without torch the cpar side still runs on data from cpar's own RNG (checking
the ctypes bindings and that the results are finite) and one line says the
comparison was skipped.

Exit status: 0 when every case ran and agreed with torch within its bound; 1
otherwise (the table marks each failure); 2 on a usage or set-up error.
"""
import argparse
import ctypes as C
import math
import os
import statistics
import sys
import time

import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy is fine here
try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the cpar side runs alone
    torch = None

# ---- cpar.h, as ctypes ------------------------------------------------------------
F32, F16, BF16, I32, I64, U8 = range(6)
DTYPE_SIZE = {F32: 4, F16: 2, BF16: 2, I32: 4, I64: 8, U8: 1}
DTYPE_NAME = {F32: "f32", F16: "f16", BF16: "bf16", I32: "i32", I64: "i64", U8: "u8"}
BACKENDS = {"host": 0, "nccl": 1, "device": 2, "sim": 2}  # sim: the device backend's old name
HOST = -1


class Tensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int), ("ndim", C.c_int), ("shape", C.c_int64 * 8),
                ("device", C.c_int)]


class InitConfig(C.Structure):
    _fields_ = [("backend", C.c_int), ("timeout_ms", C.c_int), ("workspace_bytes", C.c_size_t), ("device", C.c_int)]


class RngState(C.Structure):
    _fields_ = [("seed", C.c_uint64), ("offset", C.c_uint64)]


class AttentionConfig(C.Structure):
    _fields_ = [("causal", C.c_bool), ("scale", C.c_float), ("dropout_p", C.c_float), ("dropout_state", RngState),
                ("packed", C.c_void_p)]


class LinearConfig(C.Structure):
    _fields_ = [("input_size", C.c_int64), ("output_size", C.c_int64), ("dtype", C.c_int), ("bias", C.c_bool),
                ("gather_output", C.c_bool), ("input_is_parallel", C.c_bool), ("skip_bias_add", C.c_bool),
                ("sequence_parallel", C.c_bool), ("disable_grad_reduce", C.c_bool), ("frozen", C.c_bool),
                ("stride", C.c_int), ("skip_weight_param_allocation", C.c_bool),
                ("defer_embedding_wgrad_compute", C.c_bool), ("wgrad_deferral_limit", C.c_int),
                ("disable_gradient_accumulation_fusion", C.c_bool), ("main_grad_dtype", C.c_int)]


class AdamwConfig(C.Structure):
    _fields_ = [("lr", C.c_float), ("beta1", C.c_float), ("beta2", C.c_float), ("eps", C.c_float),
                ("weight_decay", C.c_float)]


P = C.c_void_p
T = C.POINTER(Tensor)
SIGNATURES = {  # name: (argument types); every one returns cpar_status
    "cpar_init_from_env": [C.POINTER(InitConfig), C.POINTER(P)],
    "cpar_finalize": [P], "cpar_sync": [P],
    "cpar_tensor_alloc": [P, C.c_int, C.c_int, C.POINTER(C.c_int64), T],
    "cpar_tensor_free": [P, T], "cpar_tensor_copy": [P, T, T],
    "cpar_rng_manual_seed": [P, C.c_uint64], "cpar_rng_normal": [P, T, C.c_float, C.c_float],
    "cpar_attention_forward_cfg": [P, C.POINTER(AttentionConfig), T, T, T, T, T],
    "cpar_attention_backward_cfg": [P, C.POINTER(AttentionConfig), T, T, T, T, T, T, T, T, T],
    "cpar_column_parallel_linear_create": [P, C.POINTER(LinearConfig), C.POINTER(P)],
    "cpar_linear_destroy": [P], "cpar_linear_zero_grad": [P],
    "cpar_linear_forward": [P, T, T, T], "cpar_linear_backward": [P, T, T],
    "cpar_vocab_parallel_cross_entropy_forward": [P, T, T, C.c_float, T, T],
    "cpar_vocab_parallel_cross_entropy_backward": [P, T, T, C.c_float, T, T, T],
    "cpar_rmsnorm_forward": [P, T, T, C.c_float, T], "cpar_rmsnorm_backward": [P, T, T, C.c_float, T, T, T],
    "cpar_gelu_forward": [P, T, T], "cpar_gelu_backward": [P, T, T, T], "cpar_cast": [P, T, T],
    "cpar_fill": [P, T, C.c_double],
    "cpar_adamw_step": [P, C.POINTER(AdamwConfig), C.c_int64, C.c_float, T, T, T, T, T],
}


class CparError(RuntimeError):
    pass


class Cpar:
    """A one-rank cpar context and the calls the bench makes."""

    def __init__(self, path, backend):
        self.lib = C.CDLL(path)
        for name, args in SIGNATURES.items():
            f = getattr(self.lib, name)
            f.argtypes, f.restype = args, C.c_int
        self.lib.cpar_last_error.argtypes, self.lib.cpar_last_error.restype = [P], C.c_char_p
        self.lib.cpar_thread_last_error.restype = C.c_char_p
        self.lib.cpar_world_group.argtypes, self.lib.cpar_world_group.restype = [P], P
        self.lib.cpar_linear_weight.argtypes, self.lib.cpar_linear_weight.restype = [P], Tensor
        self.lib.cpar_linear_weight_grad.argtypes, self.lib.cpar_linear_weight_grad.restype = [P], Tensor
        self.lib.cpar_version.restype = C.c_char_p
        self.lib.cpar_backend_available.argtypes, self.lib.cpar_backend_available.restype = [C.c_int], C.c_bool
        if not self.lib.cpar_backend_available(BACKENDS[backend]):
            raise CparError(f"the {backend} backend is not available here (nccl and device: no GPU visible, or "
                            "no CUDA build); --backend device --quick with build/sim/libcpar_sim.so rehearses on the CPU")
        self.ctx = P()
        cfg = InitConfig(backend=BACKENDS[backend], timeout_ms=600000)
        if self.lib.cpar_init_from_env(C.byref(cfg), C.byref(self.ctx)) != 0:
            raise CparError("cpar_init_from_env: " + self.lib.cpar_thread_last_error().decode())
        self.device = 0 if backend != "host" else HOST
        self.world = self.lib.cpar_world_group(self.ctx)
        self.live = []

    def check(self, st, what):
        if st != 0:
            raise CparError(f"{what}: {self.lib.cpar_last_error(self.ctx).decode()}")

    def call(self, name, *args):
        self.check(getattr(self.lib, name)(*args), name)

    def alloc(self, dtype, shape):
        t = Tensor()
        self.call("cpar_tensor_alloc", self.ctx, dtype, len(shape), (C.c_int64 * len(shape))(*shape), C.byref(t))
        self.live.append(t)
        return t

    def free_all(self):
        for t in self.live:
            self.lib.cpar_tensor_free(self.ctx, C.byref(t))
        self.live = []

    def sync(self):
        self.call("cpar_sync", self.ctx)


def host_view(ptr, dtype, shape):
    t = Tensor(data=ptr, dtype=dtype, ndim=len(shape), device=HOST)
    for i, n in enumerate(shape):
        t.shape[i] = n
    return t


# ---- torch, when importable ----------------------------------------------------------
if torch is not None:
    TORCH_DTYPE = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16, I32: torch.int32,
                   I64: torch.int64, U8: torch.uint8}


class Bench:
    def __init__(self, cp, args):
        self.cp, self.args = cp, args
        self.dev = "cuda" if torch is not None and args.backend == "nccl" and torch.cuda.is_available() else "cpu"
        self.gen = torch.Generator().manual_seed(1234) if torch is not None else None
        self.rows, self.failed, self.t0, self.csv = [], 0, time.monotonic(), None
        self.iters = args.iters

    # -- data
    def randn(self, shape, dtype, scale=1.0):
        """The same random tensor for both sides: (cpar tensor, torch tensor on self.dev)."""
        t = self.cp.alloc(dtype, shape)
        if torch is None:
            self.cp.call("cpar_rng_normal", self.cp.ctx, C.byref(t), 0.0, scale)
            return t, None
        h = (torch.randn(shape, generator=self.gen) * scale).to(TORCH_DTYPE[dtype]).contiguous()
        self.upload(h, t)
        return t, h.to(self.dev)

    def upload(self, h, t):
        src = host_view(h.data_ptr(), t.dtype, list(h.shape))
        self.cp.call("cpar_tensor_copy", self.cp.ctx, C.byref(src), C.byref(t))

    def download(self, t):
        shape = [t.shape[i] for i in range(t.ndim)]
        if torch is None:
            n = math.prod(shape)
            buf = (C.c_uint8 * (n * DTYPE_SIZE[t.dtype]))()
            self.cp.call("cpar_tensor_copy", self.cp.ctx, C.byref(t),
                         C.byref(host_view(C.addressof(buf), t.dtype, shape)))
            return buf
        h = torch.empty(shape, dtype=TORCH_DTYPE[t.dtype])
        self.cp.call("cpar_tensor_copy", self.cp.ctx, C.byref(t), C.byref(host_view(h.data_ptr(), t.dtype, shape)))
        return h

    def relerr(self, t, ref):
        """||cpar - torch|| / ||torch|| in fp64 on the CPU (NaN anywhere: inf)."""
        got = self.download(t)
        if torch is None:
            return None
        a, b = got.double().flatten(), ref.detach().double().cpu().flatten()
        if not torch.isfinite(a).all():
            return math.inf
        den = b.norm().item()
        return (a - b).norm().item() / (den if den > 0 else 1.0)

    # -- timing
    def sync(self):
        self.cp.sync()
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn):
        """Median over 5 batches of the mean time of `iters` calls (ms)."""
        fn()
        self.sync()
        means = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(self.iters):
                fn()
            self.sync()
            means.append((time.perf_counter() - t0) * 1e3 / self.iters)
        return statistics.median(means)

    def over_budget(self):
        return time.monotonic() - self.t0 > self.args.budget_s

    # -- results
    def row(self, section, name, shape, cpar_ms, ref_ms, ref_name, metric, err, tol):
        ok = err is None or err <= tol
        if not ok:
            self.failed += 1
        r = {"section": section, "name": name, "shape": shape, "cpar_ms": cpar_ms, "ref": ref_name,
             "ref_ms": ref_ms, "ratio": (ref_ms / cpar_ms) if (ref_ms and cpar_ms) else None, "metric": metric,
             "relerr": err, "tol": tol, "status": "ok" if ok else "FAIL"}
        self.rows.append(r)
        self.csv_row(r)
        f = lambda x, fmt: "-" if x is None else fmt % x
        print("%-5s %-26s %-22s cpar %9s ms  %-15s %9s ms  speed %6s  %-18s err %8s  %s" % (
            section, name, shape, f(cpar_ms, "%.4f"), ref_name, f(ref_ms, "%.4f"), f(r["ratio"], "%.2f"), metric,
            f(err, "%.1e"), r["status"]), flush=True)

    def skipped(self, section, what):
        print(f"{section:5s} {what}: skipped (the bench's budget of {self.args.budget_s:.0f} s is spent)", flush=True)
        self.rows.append({"section": section, "name": what, "status": "skipped"})
        self.csv_row(self.rows[-1])

    # ---- sections ----------------------------------------------------------------
    def copy_ceiling(self):
        n = self.args.mem_elems
        a, _ = self.randn([n], F32)
        b = self.cp.alloc(F32, [n])
        ms = self.time_ms(lambda: self.cp.call("cpar_tensor_copy", self.cp.ctx, C.byref(a), C.byref(b)))
        self.copy_gbps = 2 * 4 * n / ms / 1e6
        self.row("mem", "device copy (ceiling)", f"[{n}] f32", ms, None, "-", f"{self.copy_gbps:.0f} GB/s", None, 0)
        self.cp.free_all()

    def attention(self):
        a = self.args
        for d in a.attn_d:
            for s in a.attn_s:
                for causal in (False, True):
                    if self.over_budget():
                        self.skipped("attn", f"d={d} s={s} causal={causal}")
                        continue
                    self.attention_case(a.attn_b or max(1, 16384 // s), a.attn_h or max(1, 2048 // d), s, d, causal)
                    self.cp.free_all()

    def attention_case(self, b, h, s, d, causal):
        cp = self.cp
        q, tq = self.randn([b, h, s, d], BF16)
        k, tk = self.randn([b, h, s, d], BF16)
        v, tv = self.randn([b, h, s, d], BF16)
        do, tdo = self.randn([b, h, s, d], BF16)
        out, lse = cp.alloc(BF16, [b, h, s, d]), cp.alloc(F32, [b, h, s])
        dq, dk, dv = (cp.alloc(BF16, [b, h, s, d]) for _ in range(3))
        cfg = AttentionConfig(causal=causal)
        fwd = lambda: cp.call("cpar_attention_forward_cfg", cp.ctx, C.byref(cfg), C.byref(q), C.byref(k), C.byref(v),
                              C.byref(out), C.byref(lse))
        bwd = lambda: cp.call("cpar_attention_backward_cfg", cp.ctx, C.byref(cfg), C.byref(q), C.byref(k),
                              C.byref(v), C.byref(out), C.byref(do), C.byref(lse), C.byref(dq), C.byref(dk),
                              C.byref(dv))
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        shape = f"b{b} h{h} s{s} d{d}{' causal' if causal else ''}"
        fwd()
        bwd()
        ms_f, ms_b = self.time_ms(fwd), self.time_ms(bwd)
        tf_f, tf_b = flops / ms_f / 1e9, 2.5 * flops / ms_b / 1e9
        if torch is None:
            self.row("attn", "forward", shape, ms_f, None, "-", f"{tf_f:.1f} TFLOP/s", self.finite(out), 0)
            self.row("attn", "backward", shape, ms_b, None, "-", f"{tf_b:.1f} TFLOP/s", self.finite(dq), 0)
            return
        for backend in self.sdpa_backends():
            with self.sdpa(backend):
                tq_, tk_, tv_ = (x.detach().requires_grad_() for x in (tq, tk, tv))
                try:
                    ref = F.scaled_dot_product_attention(tq_, tk_, tv_, is_causal=causal)
                    grads = torch.autograd.grad(ref, (tq_, tk_, tv_), tdo, retain_graph=True)
                except RuntimeError as e:  # this backend refuses the shape
                    print(f"attn  {shape}: torch {backend} unavailable ({str(e).splitlines()[0][:80]})")
                    continue
                t_f = self.time_ms(lambda: F.scaled_dot_product_attention(tq_, tk_, tv_, is_causal=causal))
                t_b = self.time_ms(lambda: torch.autograd.grad(ref, (tq_, tk_, tv_), tdo, retain_graph=True))
            self.row("attn", "forward", shape, ms_f, t_f, backend, f"{tf_f:.1f} TFLOP/s", self.relerr(out, ref), 2e-2)
            err = max(self.relerr(x, g) for x, g in zip((dq, dk, dv), grads))
            self.row("attn", "backward", shape, ms_b, t_b, backend, f"{tf_b:.1f} TFLOP/s", err, 3e-2)
            del ref, grads

    def sdpa_backends(self):
        if self.dev != "cuda":
            return ["cpu"]
        return ["flash", "cudnn"]

    def sdpa(self, backend):
        import contextlib
        if backend == "cpu":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend])

    def finite(self, t):
        """Without torch: 0 when every element is finite, else inf (a bound of 0 then fails it)."""
        import array
        raw = bytes(self.download(t))
        if t.dtype == F32:
            vals = array.array("f", raw)
        else:  # bf16: the high half of an f32
            vals = array.array("f", b"".join(b"\0\0" + raw[i:i + 2] for i in range(0, len(raw), 2)))
        return 0.0 if all(math.isfinite(x) for x in vals) else math.inf

    def gemm(self):
        cp = self.cp
        for tokens, fin, fout in self.args.gemm:
            if self.over_budget():
                self.skipped("gemm", f"[{tokens}x{fin}] x [{fout}x{fin}]^T")
                continue
            cfg = LinearConfig(input_size=fin, output_size=fout, dtype=BF16)
            layer = P()
            cp.call("cpar_column_parallel_linear_create", cp.world, C.byref(cfg), C.byref(layer))
            try:
                w = cp.lib.cpar_linear_weight(layer)
                w_src, tw = self.randn([fout, fin], BF16, 0.02)
                cp.call("cpar_tensor_copy", cp.ctx, C.byref(w_src), C.byref(w))
                x, tx = self.randn([tokens, 1, fin], BF16)
                dy, tdy = self.randn([tokens, 1, fout], BF16)
                y, dx = cp.alloc(BF16, [tokens, 1, fout]), cp.alloc(BF16, [tokens, 1, fin])
                fwd = lambda: cp.call("cpar_linear_forward", layer, C.byref(x), C.byref(y), None)
                bwd = lambda: cp.call("cpar_linear_backward", layer, C.byref(dy), C.byref(dx))
                fwd()
                ms_f = self.time_ms(fwd)
                ms_b = self.time_ms(lambda: (fwd(), bwd()))
                ms_b = max(ms_b - ms_f, 1e-6)
                flops = 2.0 * tokens * fin * fout
                shape = f"[{tokens}x{fin}]x[{fout}x{fin}]^T"
                if torch is None:
                    self.row("gemm", "forward", shape, ms_f, None, "-", f"{flops / ms_f / 1e9:.1f} TFLOP/s",
                             self.finite(y), 0)
                    continue
                x2, dy2 = tx.view(tokens, fin), tdy.view(tokens, fout)
                ref = x2 @ tw.t()
                t_f = self.time_ms(lambda: torch.matmul(x2, tw.t()))
                t_b = self.time_ms(lambda: (torch.matmul(dy2, tw), torch.matmul(dy2.t(), x2)))
                self.row("gemm", "forward", shape, ms_f, t_f, "torch.matmul", f"{flops / ms_f / 1e9:.1f} TFLOP/s",
                         self.relerr(y, ref), 1e-2)
                # Backward: dx = dy W and the weight gradient dy^T x (cpar accumulates it into an fp32 main
                # grad: zeroed, then one backward, for the comparison).
                cp.call("cpar_linear_zero_grad", layer)
                cp.call("cpar_linear_forward", layer, C.byref(x), C.byref(y), None)
                bwd()
                dw_ref = dy2.float().t() @ x2.float()
                err = max(self.relerr(dx, dy2 @ tw), self.relerr(cp.lib.cpar_linear_weight_grad(layer), dw_ref))
                self.row("gemm", "backward", shape, ms_b, t_b, "torch.matmul",
                         f"{2 * flops / ms_b / 1e9:.1f} TFLOP/s", err, 1e-2)
            finally:
                cp.lib.cpar_linear_destroy(layer)
                cp.free_all()

    def xent(self):
        cp = self.cp
        tokens, vocab = self.args.xent
        for dt in (F32, BF16):
            if self.over_budget():
                self.skipped("xent", DTYPE_NAME[dt])
                continue
            z, tz = self.randn([tokens, vocab], dt, 2.0)
            tgt = cp.alloc(I64, [tokens])
            if torch is not None:
                ttgt = torch.randint(0, vocab, (tokens,), generator=self.gen)
                self.upload(ttgt, tgt)
                ttgt = ttgt.to(self.dev)
            else:
                cp.call("cpar_fill", cp.ctx, C.byref(tgt), 3.0)
            dl, tdl = self.randn([tokens], F32)
            loss, stats, dz = cp.alloc(F32, [tokens]), cp.alloc(F32, [tokens, 2]), cp.alloc(dt, [tokens, vocab])
            fwd = lambda: cp.call("cpar_vocab_parallel_cross_entropy_forward", cp.world, C.byref(z), C.byref(tgt),
                                  0.0, C.byref(loss), C.byref(stats))
            bwd = lambda: cp.call("cpar_vocab_parallel_cross_entropy_backward", cp.world, C.byref(z), C.byref(tgt),
                                  0.0, C.byref(stats), C.byref(dl), C.byref(dz))
            fwd()
            ms_f, ms_b = self.time_ms(fwd), self.time_ms(bwd)
            nbytes = tokens * vocab * DTYPE_SIZE[dt]
            shape = f"[{tokens}x{vocab}] {DTYPE_NAME[dt]}"
            if torch is None:
                self.row("xent", "forward", shape, ms_f, None, "-", self.gbps(nbytes, ms_f), self.finite(loss), 0)
                self.row("xent", "backward", shape, ms_b, None, "-", self.gbps(2 * nbytes, ms_b), self.finite(dz), 0)
                cp.free_all()
                continue
            zr = tz.detach().requires_grad_()
            ref = F.cross_entropy(zr.float(), ttgt, reduction="none")
            (gref,) = torch.autograd.grad(ref, zr, tdl, retain_graph=True)
            t_f = self.time_ms(lambda: F.cross_entropy(tz, ttgt, reduction="none"))
            t_b = self.time_ms(lambda: torch.autograd.grad(ref, zr, tdl, retain_graph=True))
            self.row("xent", "forward", shape, ms_f, t_f, "F.cross_entropy", self.gbps(nbytes, ms_f),
                     self.relerr(loss, ref), 1e-5 if dt == F32 else 1e-3)
            self.row("xent", "backward", shape, ms_b, t_b, "F.cross_entropy", self.gbps(2 * nbytes, ms_b),
                     self.relerr(dz, gref), 1e-5 if dt == F32 else 1e-2)
            cp.free_all()

    def gbps(self, nbytes, ms):
        return f"{nbytes / ms / 1e6:.0f} GB/s {nbytes / ms / 1e6 / self.copy_gbps:.2f} copy"

    def memory_bound(self):
        cp, n, h = self.cp, self.args.mem_elems, self.args.mem_hidden
        rows = n // h
        cases = [("rmsnorm forward", BF16), ("rmsnorm backward", BF16), ("rmsnorm backward+dw", BF16),
                 ("gelu forward", BF16),
                 ("gelu backward", BF16), ("cast f32->bf16", F32), ("cast bf16->f32", BF16), ("adamw step", F32)]
        for name, dt in cases:
            if self.over_budget():
                self.skipped("mem", name)
                continue
            x, tx = self.randn([rows, h], dt)
            if name.startswith("rmsnorm"):
                w, tw = self.randn([h], BF16)
                y, dy, tdy = cp.alloc(BF16, [rows, h]), *self.randn([rows, h], BF16)
                dx, dw = cp.alloc(BF16, [rows, h]), cp.alloc(F32, [h])
                if name.endswith("forward"):
                    fn = lambda: cp.call("cpar_rmsnorm_forward", cp.ctx, C.byref(x), C.byref(w), 1e-5, C.byref(y))
                    nbytes, out = 2 * 2 * n, y
                    ref_fn = lambda: F.rms_norm(tx, (h,), tw, 1e-5)
                    ref = (lambda: F.rms_norm(tx.float(), (h,), tw.float(), 1e-5)) if torch is not None else None
                else:  # "+dw": the weight's gradient too (dweight, F32, accumulated), as in training
                    cp.call("cpar_fill", cp.ctx, C.byref(dw), 0.0)
                    wdw = name.endswith("+dw")
                    fn = lambda: cp.call("cpar_rmsnorm_backward", cp.ctx, C.byref(x), C.byref(w), 1e-5, C.byref(dy),
                                         C.byref(dx), C.byref(dw) if wdw else None)
                    nbytes, out = 3 * 2 * n + (8 * h if wdw else 0), dx
                    if torch is not None:
                        xr, wr = tx.detach().requires_grad_(), tw.detach().requires_grad_(wdw)
                        yr = F.rms_norm(xr, (h,), wr, 1e-5)
                        ref_fn = lambda: torch.autograd.grad(yr, (xr, wr) if wdw else xr, tdy, retain_graph=True)
                        xf = tx.float().requires_grad_()
                        ref = lambda: torch.autograd.grad(F.rms_norm(xf, (h,), tw.float(), 1e-5), xf, tdy.float())[0]
            elif name.startswith("gelu"):
                y = cp.alloc(BF16, [rows, h])
                if name.endswith("forward"):
                    fn = lambda: cp.call("cpar_gelu_forward", cp.ctx, C.byref(x), C.byref(y))
                    nbytes, out = 2 * 2 * n, y
                    ref_fn = lambda: F.gelu(tx, approximate="tanh")
                    ref = lambda: F.gelu(tx.float(), approximate="tanh")
                else:
                    dy, tdy = self.randn([rows, h], BF16)
                    fn = lambda: cp.call("cpar_gelu_backward", cp.ctx, C.byref(x), C.byref(dy), C.byref(y))
                    nbytes, out = 3 * 2 * n, y
                    if torch is not None:
                        xr = tx.detach().requires_grad_()
                        yr = F.gelu(xr, approximate="tanh")
                        ref_fn = lambda: torch.autograd.grad(yr, xr, tdy, retain_graph=True)
                        xf = tx.float().requires_grad_()
                        ref = lambda: torch.autograd.grad(F.gelu(xf, approximate="tanh"), xf, tdy.float())[0]
            elif name.startswith("cast"):
                odt = BF16 if dt == F32 else F32
                y = cp.alloc(odt, [rows, h])
                fn = lambda: cp.call("cpar_cast", cp.ctx, C.byref(x), C.byref(y))
                nbytes, out = (DTYPE_SIZE[dt] + DTYPE_SIZE[odt]) * n, y
                if torch is not None:
                    ref_fn = ref = lambda: tx.to(TORCH_DTYPE[odt])
            else:  # AdamW: grad, master, m, v f32 and a bf16 parameter
                g, tg = x, tx
                master, tmaster = self.randn([rows, h], F32)
                m, tm = self.randn([rows, h], F32, 0.1)
                v, tv = self.randn([rows, h], F32, 0.1)
                param = cp.alloc(BF16, [rows, h])
                if torch is not None:
                    tv = tv.abs()
                    self.upload(tv.cpu(), v)
                else:  # v >= 0, as a second moment is
                    cp.call("cpar_fill", cp.ctx, C.byref(v), 0.01)
                acfg = AdamwConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
                fn = lambda: cp.call("cpar_adamw_step", cp.ctx, C.byref(acfg), 10, 1.0, C.byref(g), C.byref(master),
                                     C.byref(m), C.byref(v), C.byref(param))
                nbytes, out = (16 + 12 + 2) * n, master
                if torch is not None:
                    def ref():  # one step of the formula in fp64, from the uploaded state
                        gg, mm, vv, pp = tg.double(), tm.double(), tv.double(), tmaster.double()
                        pp = pp * (1 - 1e-3 * 0.1)
                        mm, vv = 0.9 * mm + 0.1 * gg, 0.95 * vv + 0.05 * gg * gg
                        return pp - 1e-3 / (1 - 0.9 ** 10) * mm / ((vv / (1 - 0.95 ** 10)).sqrt() + 1e-8)
                    tp = tmaster.clone().requires_grad_()
                    tp.grad = tg.clone()
                    opt = torch.optim.AdamW([tp], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                            fused=self.dev == "cuda")
                    ref_fn = opt.step
            shape = f"[{rows}x{h}] {DTYPE_NAME[dt]}"
            if torch is None:
                fn()
                ms = self.time_ms(fn)
                self.row("mem", name, shape, ms, None, "-", self.gbps(nbytes, ms), self.finite(out), 0)
                cp.free_all()
                continue
            fn()
            err = self.relerr(out, ref())  # before timing: AdamW's state moves with every call
            ms = self.time_ms(fn)
            t_ref = self.time_ms(ref_fn)
            self.row("mem", name, shape, ms, t_ref, "torch", self.gbps(nbytes, ms), err,
                     0.0 if name.startswith("cast") else 1e-5 if name.startswith("adamw") else 1e-2)
            cp.free_all()

    CSV_COLS = ["section", "name", "shape", "cpar_ms", "ref", "ref_ms", "ratio", "metric", "relerr", "tol", "status"]

    def open_csv(self, path):
        """Rows go out as they come, so a run stopped at its limit keeps what it measured."""
        self.csv = open(path, "w") if path else None
        if self.csv:
            self.csv.write("# cpar gpu_bench %s; %s\n" % (self.cp.lib.cpar_version().decode(), self.machine()))
            self.csv.write(",".join(self.CSV_COLS) + "\n")
            self.csv.flush()

    def csv_row(self, r):
        if self.csv:
            self.csv.write(",".join("" if r.get(c) is None else str(r[c]).replace(",", ";") for c in self.CSV_COLS)
                           + "\n")
            self.csv.flush()

    def summary(self):
        """A short table (the device tool's reply carries only the output's tail): per case cpar's rate and its
        speed against each reference (the reference's time over cpar's: 1.0 is parity, above 1 cpar is faster)."""
        print("== gpu_bench summary: speed = reference time / cpar time; err = normwise relative error")
        cases = {}
        for r in self.rows:
            if r.get("status") == "skipped":
                print(f"{r['section']:5s} {r['name']}: skipped (budget)")
                continue
            key = (r["section"], r["name"], r["shape"])
            c = cases.setdefault(key, {"metric": r["metric"], "speed": [], "err": 0.0, "status": "ok"})
            if r["ratio"] is not None:
                c["speed"].append(f"{r['ratio']:.2f} {r['ref']}")
            c["err"] = max(c["err"], r["relerr"] or 0.0)
            if r["status"] != "ok":
                c["status"] = r["status"]
        for (sec, name, shape), c in cases.items():
            print("%-4s %-21s %-26s %-21s %-30s err %.0e %s" % (sec, name, shape, c["metric"], ", ".join(c["speed"]),
                                                                 c["err"], c["status"]))

    def machine(self):
        dev = torch.cuda.get_device_name(0) if self.dev == "cuda" else "cpu"
        return "device %s; torch %s; date %s" % (dev, torch.__version__ if torch else "none",
                                                 time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def sizes(s):
    return [int(x) for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True, help="a shared cpar: build/cuda/libcpar.so.*, or build/sim/libcpar_sim.so")
    ap.add_argument("--backend", default="nccl", choices=sorted(BACKENDS))
    ap.add_argument("--quick", action="store_true", help="the rehearsal's small sizes (the CUDA simulator is slow)")
    ap.add_argument("--only", default="mem,gemm,xent,attn", help="sections (default all)")
    ap.add_argument("--attn-s", type=sizes, dest="only_s", help="attention sequence lengths (default 1024,...,16384)")
    ap.add_argument("--attn-d", type=sizes, dest="only_d", help="attention head dims (default 64,128)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip what is left after this many seconds")
    ap.add_argument("--csv", help="write every row here")
    args = ap.parse_args()
    if args.quick:
        args.iters, args.attn_d, args.attn_s, args.attn_b, args.attn_h = 1, [64], [64], 1, 2
        args.gemm, args.xent, args.mem_elems, args.mem_hidden = [(32, 64, 96)], (16, 100), 4096, 256
    else:
        args.iters, args.attn_d, args.attn_s, args.attn_b, args.attn_h = 10, [64, 128], [1024, 2048, 4096, 8192,
                                                                                        16384], 0, 0
        args.gemm = [(8192, 4096, 4096), (8192, 4096, 16384), (8192, 16384, 4096)]
        args.xent, args.mem_elems, args.mem_hidden = (8192, 50304), 64 << 20, 4096
    args.attn_s, args.attn_d = args.only_s or args.attn_s, args.only_d or args.attn_d
    try:
        cp = Cpar(args.lib, args.backend)
    except (OSError, CparError) as e:
        print(f"gpu_bench: {e}", file=sys.stderr)
        return 2
    b = Bench(cp, args)
    b.open_csv(args.csv)
    print(f"gpu_bench: cpar {cp.lib.cpar_version().decode()} on the {args.backend} backend; {b.machine()}")
    if torch is None:
        print("gpu_bench: torch is not importable here: the side-by-side comparison is skipped (cpar's side runs)")
    only = args.only.split(",")
    try:
        b.copy_ceiling()
        # the quick sections first: attention's long shapes take what is left of the budget
        for name, section in (("mem", b.memory_bound), ("gemm", b.gemm), ("xent", b.xent), ("attn", b.attention)):
            if name in only:
                section()
    except CparError as e:
        print(f"gpu_bench: {e}", flush=True)
        b.failed += 1
    cp.lib.cpar_finalize(cp.ctx)
    b.summary()
    bad = [r for r in b.rows if r.get("status") == "FAIL"]
    print(f"gpu_bench: {len(b.rows)} rows, {len(bad)} outside their bound{'; failed' if b.failed else ''}")
    return 1 if b.failed else 0


if __name__ == "__main__":
    sys.exit(main())
