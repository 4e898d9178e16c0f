"""GPU check and timing of the Pallas INT4 matmul kernels (pallas_kernels/gpu_matmul.py).

Run on the device (the H200), from the repository root:

    PYTHONPATH=. python3 -m bench.kernels [--parts bw,check,sweep,table] [--out DIR]

1. ``bw``: device copy bandwidth (a large ``a + 1`` over bf16, bytes read + written).
2. ``check``: on the GPU, W4A4/W4A8 kernel vs ``reference.quantized_matmul`` run on the GPU too
   (bitwise), the int32 group accumulations vs ``reference.group_accumulate`` (bitwise), W4A16 vs
   float64 numpy on the host (relative error), row-count invariance (rows of M=1 calls inside
   M = 4, 16, 64 calls, bitwise), for symmetric g128, asymmetric g32 and per-channel weights.
3. ``sweep``: a few (block_n, block_k, num_warps, num_stages) per kernel and Llama-3-8B shape at
   M=1; the fastest is used in the table.
4. ``table``: Llama-3-8B layer shapes x M in {1, 16, 64, 256}: the W4A16 kernel, the W4A4 kernel
   (its quantization step included; at M=1 also the kernel alone), and XLA's bf16 dot on dense bf16
   weights. Each timing jits R >= 32 call sites over distinct input buffers (weights rotated over
   enough copies to exceed the 60 MB L2 3.5 times). Two times per call: GPU time, the sum of the
   kernel durations in a CUPTI trace (jax.profiler) of one dispatch, divided by R; and wall time,
   the median over repeats of (4 back-to-back dispatches, then one block) / (4 R), launch gaps
   included. GB/s on the bytes each call must move (weights + scales + bf16 activations + f32
   output) and % of the measured copy bandwidth (f32 ``a + 1``, kernel time).

Prints a short table last; writes ``kernels.json`` and ``kernels.md`` under ``--out`` (default
``$OUT``, else bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gpu_matmul as gm
from pallas_kernels import reference as ref
from pallas_kernels.layout import QuantizedWeight, dequantize

SHAPES = {  # Llama-3-8B decoder linears (N, K)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
MS = (1, 16, 64, 256)
CHECK_CASES = [("o g128 sym", 4096, 4096, 128, True), ("o g32 asym", 4096, 4096, 32, False),
               ("down per-channel sym", 4096, 14336, 14336, True)]
GROUP = 128  # the table's weights: symmetric, group 128
L2_BYTES = 60e6
CALLS = 32  # call sites per timed jit (dispatch overhead / CALLS per call)
KW: dict = {}  # extra keyword arguments for every kernel call ({"interpret": True} in --smoke)

# W4A16: (block_n, block_k, split_k, num_warps, num_stages, block_m); split_k None = the default
# rule (N / block_n * split >= 264 programs). Version 2 of the kernel (weight tile on the MMA's M
# side, even/odd K halves); version 1's sweep had found bn=32, bk=512, split 2 fastest.
W4A16_CONFIGS = [
    (64, 256, None, 4, 3, 16), (64, 512, None, 4, 3, 16), (128, 256, None, 4, 3, 16),
    (128, 256, None, 8, 3, 16), (64, 256, None, 4, 4, 16), (32, 256, None, 4, 3, 16),
    (64, 128, None, 4, 4, 16), (128, 512, None, 8, 3, 16), (64, 256, 1, 4, 3, 16),
    (64, 256, None, 4, 3, 32), (64, 256, None, 4, 3, 64), (128, 256, None, 8, 3, 64),
]
# W4AX: (block_n, block_k, split_k, num_warps, num_stages). A first sweep (bn 16..128, bk 128..512,
# no split) found bn=32 with bk=512 or 128 fastest; this one explores around it.
W4AX_CONFIGS = [
    (32, 512, 1, 4, 3), (64, 128, 1, 4, 3), (32, 512, 2, 4, 3), (32, 512, 4, 4, 3),
    (32, 256, 2, 4, 3), (64, 512, 2, 4, 3), (32, 512, 1, 8, 3),
]


def log(*a):
    print(*a, flush=True)


def make_weight(key, n, k, group, symmetric) -> QuantizedWeight:
    k1, k2, k3 = jax.random.split(key, 3)
    packed = jax.random.bits(k1, (n, k // 2), jnp.uint8)
    scales = jax.random.uniform(k2, (n, k // group), jnp.float32, 0.002, 0.02).astype(jnp.float16)
    mins = None if symmetric else (0.05 * jax.random.normal(k3, (n, k // group))).astype(jnp.float16)
    return QuantizedWeight(packed, scales, mins, group)


def weight_bytes(n, k, group, symmetric):
    return n * k // 2 + n * (k // group) * 2 * (1 if symmetric else 2)


def time_calls(fn, arg_sets, reps, inner=4):
    """Median seconds per call of ``fn`` over the argument sets, all called inside one jit.

    Each repeat dispatches the jit ``inner`` times back to back and blocks once, so the host's
    dispatch overlaps the device's work and the GPU queue stays full."""
    f = jax.jit(lambda sets: [fn(*a) for a in sets])
    t0 = time.perf_counter()
    jax.block_until_ready(f(arg_sets))
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        jax.block_until_ready(f(arg_sets))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [f(arg_sets) for _ in range(inner)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t) / (inner * len(arg_sets)))
        del outs
    return statistics.median(ts), min(ts), max(ts), compile_s


_PROFILE_N = [0]


def gpu_time(fn, arg_sets, tmp: Path):
    """GPU busy time per call (sum of kernel durations from a CUPTI trace of one jit dispatch of
    all call sites), and the kernels seen: {name: (count, total_us)}."""
    from jax.profiler import ProfileData

    f = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(f(arg_sets))
    _PROFILE_N[0] += 1
    d = tmp / f"trace{_PROFILE_N[0]}"
    jax.profiler.start_trace(str(d))
    jax.block_until_ready(f(arg_sets))
    jax.profiler.stop_trace()
    files = sorted(d.rglob("*.xplane.pb"))
    if not files:
        return None, {}
    pd = ProfileData.from_file(str(files[-1]))
    kernels: dict = {}
    seen = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            seen.append(f"{plane.name}|{line.name}")
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                c, t = kernels.get(e.name, (0, 0.0))
                kernels[e.name] = (c + 1, t + e.duration_ns / 1e3)
    if not kernels:
        if _PROFILE_N[0] <= 2:
            log(f"trace: no kernel events; planes {[p.name for p in pd.planes]}, GPU lines {seen}")
        return None, {}
    if _PROFILE_N[0] <= 2:
        log(f"trace lines: {seen}")
    total_us = sum(t for _, t in kernels.values())
    return total_us / len(arg_sets), {k[:80]: (c, round(t / len(arg_sets), 3)) for k, (c, t) in kernels.items()}


# ------------------------------------------------------------------------------------------ parts

def copy_bandwidth(res, tmp, n=1 << 30):
    """``a + 1`` over float32 (the first run, 2026-11-30, used bf16 ``a + 1``: only 2.78 TB/s)."""
    a = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    f = jax.jit(lambda v: v + 1.0)
    jax.block_until_ready(f(a))
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(f(a))
        ts.append(time.perf_counter() - t)
    nbytes = 2 * 4 * n
    bw = nbytes / statistics.median(ts)
    g, kern = gpu_time(lambda v: v + 1.0, [(a,)], tmp)
    res["copy_bw_wall"] = bw
    res["copy_bw"] = nbytes / (g * 1e-6) if g else bw
    log(f"copy bandwidth: {res['copy_bw'] / 1e12:.2f} TB/s by kernel time ({g} us), {bw / 1e12:.2f} TB/s by "
        f"wall (median of 10, {nbytes / 1e9:.2f} GB moved, spread {min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f} ms) "
        f"{kern}")
    del a


def check(res, rng):
    cases = CHECK_CASES
    out = res.setdefault("check", [])
    ref_mm = jax.jit(ref.quantized_matmul, static_argnames="mode")
    j16 = jax.jit(lambda a, w: gm.w4a16_matmul(a, w, **KW))
    jax_ = jax.jit(lambda a, w, bits: gm.w4ax_matmul(a, w, bits, **KW), static_argnums=2)
    ok_all = True
    for ci, (name, n, k, g, sym) in enumerate(cases):
        w = make_weight(jax.random.key(100 + ci), n, k, g, sym)
        xh = rng.standard_normal((64, k)) * np.exp(rng.standard_normal((64, 1)))
        xh[:, rng.integers(0, k, 8)] *= 10.0
        x = jnp.asarray(xh.astype(np.float32))
        w64 = np.asarray(dequantize(w, jnp.float32), np.float64)
        alone = {}
        for kern in ("w4a16", "w4a4"):
            f = (lambda a: j16(a, w)) if kern == "w4a16" else (lambda a: jax_(a, w, 4))
            alone[kern] = np.stack([np.asarray(f(x[i:i + 1]))[0] for i in (0, 1, 3)])
        for m in (1, 4, 16, 64):
            xm = x[:m]
            row = {"case": name, "M": m}
            y16 = np.asarray(j16(xm, w), np.float64)
            exact = np.asarray(xm, np.float64) @ w64.T
            row["w4a16_rel_err_vs_f64"] = float(np.linalg.norm(y16 - exact) / np.linalg.norm(exact))
            row["w4a16_finite"] = bool(np.isfinite(y16).all())
            for bits, mode in ((4, "w4a4"), (8, "w4a8")):
                if bits == 8 and m not in (1, 16):
                    continue
                y = np.asarray(jax_(xm, w, bits))
                r = np.asarray(ref_mm(xm, w, mode=mode))
                row[f"{mode}_mismatches"] = int((y != r).sum())
                row[f"{mode}_max_rel_diff"] = float(np.abs(y - r).max() / np.abs(r).max())
            inv = {}
            for kern, yk in (("w4a16", y16.astype(np.float32)), ("w4a4", None)):
                if yk is None:
                    yk = np.asarray(jax_(xm, w, 4))
                rows = [j for j, i in enumerate((0, 1, 3)) if i < m]
                if m > 1:
                    inv[kern] = bool(np.array_equal(yk[[(0, 1, 3)[j] for j in rows]], alone[kern][rows]))
            row["invariant"] = inv
            if m == 16:
                qx, sa = jax.jit(ref.quantize_activations, static_argnums=1)(xm, 4)
                acc = gm.w4ax_quantized(qx, sa, w, return_acc=True, **KW)
                racc = jax.jit(ref.group_accumulate, static_argnums=2)(qx, ref.signed_codes(w), g)
                row["group_acc_bitwise"] = bool(jnp.array_equal(acc, racc.transpose(1, 0, 2)))
            if ci == 0 and m == 16:  # split-K path: tolerance vs reference, invariance vs M=1
                s16 = jax.jit(lambda a, w: gm.w4a16_matmul(a, w, split_k=2, block_k=128, **KW))
                s4 = jax.jit(lambda a, w: gm.w4ax_matmul(a, w, 4, split_k=2, block_k=128, **KW))
                ys = np.asarray(s16(xm, w), np.float64)
                row["split2_w4a16_rel_err_vs_f64"] = float(np.linalg.norm(ys - exact) / np.linalg.norm(exact))
                y4s = np.asarray(s4(xm, w))
                r4 = np.asarray(ref_mm(xm, w, mode="w4a4"))
                row["split2_w4a4_max_rel_diff"] = float(np.abs(y4s - r4).max() / np.abs(r4).max())
                inv["split2_w4a16"] = bool(np.array_equal(np.asarray(s16(x[3:4], w))[0], ys[3].astype(np.float32)))
                inv["split2_w4a4"] = bool(np.array_equal(np.asarray(s4(x[3:4], w))[0], y4s[3]))
                ok_split = row["split2_w4a16_rel_err_vs_f64"] < 1e-2 and row["split2_w4a4_max_rel_diff"] < 1e-6
            else:
                ok_split = True
            good = (ok_split and row["w4a16_rel_err_vs_f64"] < 1e-2 and row["w4a16_finite"]
                    and row.get("w4a4_max_rel_diff", 0) < 1e-6 and row.get("w4a8_max_rel_diff", 0) < 1e-6
                    and all(inv.values()) and row.get("group_acc_bitwise", True))
            ok_all &= good
            row["ok"] = good
            out.append(row)
            log("check", json.dumps(row))
    res["check_ok"] = ok_all
    log(f"CHECK {'PASSED' if ok_all else 'FAILED'}")


def _weights(n, k, group, symmetric, per_copy_bytes, seed):
    copies = max(2, int(np.ceil(3.5 * L2_BYTES / per_copy_bytes)))
    ws = [make_weight(jax.random.key(seed + c), n, k, group, symmetric) for c in range(copies)]
    return ws


def _xs(m, k, count, dtype=jnp.float32):
    return [jax.random.normal(jax.random.key(1000 + i), (m, k), dtype) for i in range(count)]


def _bytes(kind, m, n, k):
    if kind == "bf16":
        return n * k * 2 + m * k * 2 + m * n * 4
    act = m * k * 2  # the activations as the caller holds them (bf16)
    return weight_bytes(n, k, GROUP, True) + act + m * n * 4


def _fn(kind, cfg):
    bn, bk, sk, nw, ns = cfg[:5]
    kw = dict(block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=ns, **KW)
    if kind == "w4a16":
        bm = cfg[5] if len(cfg) > 5 else None
        return lambda x, w: gm.w4a16_matmul(x, w, block_m=bm, **kw)
    if kind == "w4a4":
        return lambda x, w: gm.w4ax_matmul(x, w, 4, **kw)
    if kind == "w4a4_kernel":
        return lambda q, s, w: gm.w4ax_quantized(q, s, w, **kw)
    raise ValueError(kind)


def _valid(cfg, n, k, g=GROUP):
    bn, bk, sk = cfg[:3]
    if sk is None:
        return n % bn == 0 and k % bk == 0
    return n % bn == 0 and k % bk == 0 and (k // sk) % max(g, bk) == 0


SWEEP_KINDS = ["w4a16", "w4a4"]
TABLE_KINDS = ["w4a16", "w4a4", "xla"]
SWEEP_MS = {"w4a16": (1, 64), "w4a4": (1,)}


def sweep(res, reps, deadline, tmp):
    """Each config at M=1 (and W4A16 at M=64 too); the fastest at M=1 goes to the table."""
    best = res.setdefault("best", {})
    rows = res.setdefault("sweep", [])
    t_start = time.time()
    for si, (sname, (n, k)) in enumerate(SHAPES.items()):
        shape_deadline = t_start + (deadline - t_start) * (si + 1) / len(SHAPES)
        ws = _weights(n, k, GROUP, True, weight_bytes(n, k, GROUP, True), 10)
        calls = max(CALLS, len(ws))
        xsm = {m: _xs(m, k, calls, jnp.bfloat16) for m in (1, 64)}
        for kind, cfgs in (("w4a16", W4A16_CONFIGS), ("w4a4", W4AX_CONFIGS)):
            if kind not in SWEEP_KINDS:
                continue
            for cfg, m in [(c, m) for c in cfgs for m in SWEEP_MS[kind]]:
                if not _valid(cfg, n, k) or time.time() > shape_deadline:
                    continue
                xs = xsm[m]
                try:
                    sets = [(xs[i], ws[i % len(ws)]) for i in range(calls)]
                    med, lo, hi, cs = time_calls(_fn(kind, cfg), sets, reps)
                    gpu, kern = gpu_time(_fn(kind, cfg), sets, tmp)
                except Exception as e:  # a config Triton rejects: log it and go on
                    log(f"sweep {sname} {kind} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    rows.append({"shape": sname, "kind": kind, "cfg": cfg, "error": str(e)[:500]})
                    continue
                score = gpu if gpu is not None else med * 1e6
                rows.append({"shape": sname, "kind": kind, "cfg": cfg, "M": m, "wall_us": med * 1e6,
                             "min_us": lo * 1e6, "max_us": hi * 1e6, "compile_s": cs, "gpu_us": gpu, "kernels": kern})
                log(f"sweep {sname:8s} {kind:6s} M={m:2d} bn={cfg[0]:3d} bk={cfg[1]:4d} split={cfg[2]} "
                    f"warps={cfg[3]} stages={cfg[4]} bm={cfg[5] if len(cfg) > 5 else '-'}: gpu {score:8.2f} us, "
                    f"wall {med * 1e6:8.2f} us (min {lo * 1e6:.2f}, max {hi * 1e6:.2f}; compile {cs:.1f}s) {kern}")
                key = f"{sname}/{kind}" + ("" if m == 1 else f"/M{m}")
                if key not in best or score < best[key]["us"]:
                    best[key] = {"cfg": cfg, "us": score}
        del ws
    log("best configs:", json.dumps(best))


def _entry(nbytes, med, lo, hi, gpu, kern, bw, cfg):
    """Timing entry: ``us`` is the GPU time (kernel durations) when the trace gave one, else wall."""
    us = gpu if gpu is not None else med * 1e6
    return {"cfg": cfg, "us": us, "wall_us": med * 1e6, "wall_min_us": lo * 1e6, "wall_max_us": hi * 1e6,
            "GBps": nbytes / us / 1e3, "pct_copy": 100 * nbytes / (us * 1e-6) / bw if bw else None,
            "wall_pct_copy": 100 * nbytes / med / bw if bw else None, "kernels": kern}


def table(res, reps, tmp):
    bw = res.get("copy_bw")
    best = res.get("best", {})
    rows = res.setdefault("table", [])
    for sname, (n, k) in SHAPES.items():
        wb4 = weight_bytes(n, k, GROUP, True)
        ws4 = _weights(n, k, GROUP, True, wb4, 10)
        for m in MS:
            calls = max(CALLS, len(ws4))
            entry = {"shape": sname, "N": n, "K": k, "M": m}
            xs = _xs(m, k, calls, jnp.bfloat16)
            for kind in ("w4a16", "w4a4") + (("w4a4_kernel",) if m == 1 else ()):
                if kind.split("_")[0] not in TABLE_KINDS:
                    continue
                base = "w4a4" if kind == "w4a4_kernel" else kind
                if base == "w4a16":
                    dflt = (*gm.default_config(n, k, GROUP, "w4a16"), *gm.w4a16_launch(n, k, GROUP)[1:],
                            gm.w4a16_launch(n, k, GROUP)[0])
                else:
                    dflt = (*gm.default_config(n, k, GROUP, "w4ax"), 4, 3)
                cfg = tuple(best.get(f"{sname}/{base}", {}).get("cfg") or dflt)
                if kind == "w4a4_kernel":
                    qs = [jax.jit(ref.quantize_activations, static_argnums=1)(x, 4) for x in xs]
                    sets = [(qs[i][0], qs[i][1], ws4[i % len(ws4)]) for i in range(calls)]
                else:
                    sets = [(xs[i], ws4[i % len(ws4)]) for i in range(calls)]
                try:
                    med, lo, hi, cs = time_calls(_fn(kind, cfg), sets, reps)
                    gpu, kern = gpu_time(_fn(kind, cfg), sets, tmp)
                except Exception as e:
                    log(f"table {sname} M={m} {kind}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                entry[kind] = _entry(_bytes(kind, m, n, k), med, lo, hi, gpu, kern, bw, cfg)
            rows.append(entry)
        del ws4
        if "xla" not in TABLE_KINDS:
            for entry in rows[-len(MS):]:
                log("table", json.dumps(entry))
            continue
        # dense bf16 weights for XLA's dot
        wbf = n * k * 2
        copies = max(2, int(np.ceil(3.5 * L2_BYTES / wbf)))
        wd = [jax.random.normal(jax.random.key(500 + c), (n, k), jnp.bfloat16) for c in range(copies)]
        dot = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        for entry in rows[-len(MS):]:
            m = entry["M"]
            calls = max(CALLS, copies)
            xs = _xs(m, k, calls, jnp.bfloat16)
            sets = [(xs[i], wd[i % copies]) for i in range(calls)]
            med, lo, hi, cs = time_calls(dot, sets, reps)
            gpu, kern = gpu_time(dot, sets, tmp)
            entry["xla_bf16"] = _entry(_bytes("bf16", m, n, k), med, lo, hi, gpu, kern, bw, None)
            log("table", json.dumps(entry))
        del wd


def markdown(res) -> str:
    bw = res.get("copy_bw")
    lines = [f"Copy bandwidth (f32 `a + 1`, read + write, kernel time): {bw / 1e12:.2f} TB/s" if bw else "",
             "µs = GPU time per call (sum of its kernels' durations, CUPTI trace); wall = per call "
             "inside a jit of 32+ calls, launch gaps included.",
             "", "| shape (N×K) | M | W4A16 µs | %BW | wall | W4A4 µs | %BW | wall | W4A4 kernel-only µs | "
                 "XLA bf16 µs | %BW | wall | W4A16 vs bf16 (GPU µs) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in res.get("table", []):
        def g(kind, key="us", fmt="{:.1f}"):
            v = e.get(kind, {}).get(key)
            return fmt.format(v) if v is not None else "–"
        sp = (e["xla_bf16"]["us"] / e["w4a16"]["us"]) if "w4a16" in e and "xla_bf16" in e else None
        lines.append(f"| {e['shape']} {e['N']}×{e['K']} | {e['M']} | {g('w4a16')} | {g('w4a16', 'pct_copy', '{:.0f}%')} | "
                     f"{g('w4a16', 'wall_us')} | {g('w4a4')} | {g('w4a4', 'pct_copy', '{:.0f}%')} | {g('w4a4', 'wall_us')} | "
                     f"{g('w4a4_kernel')} | {g('xla_bf16')} | {g('xla_bf16', 'pct_copy', '{:.0f}%')} | "
                     f"{g('xla_bf16', 'wall_us')} | {'–' if sp is None else f'{sp:.2f}×'} |")
    return "\n".join(lines)


def main(argv=None):
    global SHAPES, MS, CHECK_CASES, L2_BYTES, CALLS, W4A16_CONFIGS, W4AX_CONFIGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="bw,check,sweep,table")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sweep-budget-s", type=float, default=170.0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="table row counts")
    ap.add_argument("--sweep-kinds", default="w4a16,w4a4")
    ap.add_argument("--table-kinds", default="w4a16,w4a4,xla")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU check of this script)")
    args = ap.parse_args(argv)
    if args.smoke:
        SHAPES = {"tiny": (32, 256)}
        MS = (1, 16)
        CHECK_CASES = [("tiny g32 asym", 32, 256, 32, False), ("tiny per-channel", 32, 256, 256, True)]
        L2_BYTES, CALLS = 1e4, 2
        W4A16_CONFIGS, W4AX_CONFIGS = [(16, 128, 1, 4, 3, 16), (16, 128, 2, 4, 3, 16)], [(16, 128, 2, 4, 3)]
        KW["interpret"] = True
    if not args.smoke:
        MS = tuple(int(v) for v in args.ms.split(","))
        SHAPES = {s: SHAPES[s] for s in args.shapes.split(",")}
    SWEEP_KINDS[:] = args.sweep_kinds.split(",")
    TABLE_KINDS[:] = args.table_kinds.split(",")
    parts = args.parts.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    seed = int.from_bytes(os.urandom(4), "little")
    log(f"devices: {jax.devices()}  jax {jax.__version__}  seed {seed}")
    res = {"seed": seed, "device": str(jax.devices()[0].device_kind)}
    rng = np.random.default_rng(seed)

    def save():
        (args.out / "kernels.json").write_text(json.dumps(res, indent=1))

    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix="kernels_trace"))
    steps = [("bw", lambda: copy_bandwidth(res, tmp, 1 << (20 if args.smoke else 30))), ("check", lambda: check(res, rng)),
             ("sweep", lambda: sweep(res, args.reps, time.time() + args.sweep_budget_s, tmp)),
             ("table", lambda: table(res, args.reps, tmp))]
    for name, step in steps:
        if name not in parts:
            continue
        t = time.time()
        try:
            step()
        except Exception:
            log(f"step {name} FAILED:\n{traceback.format_exc()}")
            res[f"{name}_error"] = traceback.format_exc()[-3000:]
        log(f"[{name} took {time.time() - t:.0f}s]")
        save()
    md = markdown(res)
    (args.out / "kernels.md").write_text(md + "\n")
    log("\n" + md)
    if "check" in parts:
        log(f"GPU correctness checks: {'PASSED' if res.get('check_ok') else 'FAILED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
