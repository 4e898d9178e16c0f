"""One GPU run of the Pallas kernels against XLA. From the repository root:

    PYTHONPATH=. python3 -m bench.kernels [--parts check,attn,table] [--models llama3-8b,llama2-7b,llama2-13b]
        [--ms 1,4,8,16,32,64,128,256] [--kinds w4a16,mosaic_w4a16] [--mosaic-programs 264] [--out DIR] [--resume OLD.json]
        [--budget-s 480] [--threads 8] [--smoke]

Writes ``kernels.json`` and ``kernels.md`` under ``--out`` (default ``$OUT``, else bench/results; the
json after every shape, so a killed run leaves what it measured). The md starts with the command
line(s) that made it and the copy bandwidth each measured. Prints a short summary last.

* Copy bandwidth, measured first whenever ``attn`` or ``table`` runs: f32 ``a + 1`` over 4.3 GB,
  bytes read + written / kernel time. Every "% BW" is against this number of the same run.
* ``check``: correctness on the GPU. W4A4/W4A8 vs ``reference.quantized_matmul`` run on the GPU,
  int32 group accumulations vs ``reference.group_accumulate`` (bitwise), W4A16 vs float64 on the
  host (relative error), rows of M=1 calls bitwise equal to the same rows inside M = 4/16/64 calls,
  split-K 2; for symmetric g128, asymmetric g32 and per-channel weights.
* ``attn``: ``pallas_kernels.gpu_attention.decode_attention`` (imported here only; without it, XLA
  alone is timed) vs XLA's ``reference.attention`` (jitted, ``k_pos = arange(S)``), Llama-3-8B
  heads (H 32, KV 8, d 128), bf16, batch 8-64, context 1k-8k (the cache holds exactly the context,
  every slot visible), T = 1 or 4 new queries. Floor = (K + V cache + q + output bytes) / copy
  bandwidth. Also the kernel's max |difference| to XLA's output over max |XLA output|. The same
  kernel over the draft's INT8 and INT4 KV shadow of that cache (``scales=``, the codes of
  ``reference.quantize_kv`` and head-major float32 scales), each against its own floor (codes +
  scales + q + output bytes), its difference taken to XLA attending over the dequantized shadow.
* ``table``: for each model of ``--models``, its layer shapes (fused qkv, o, fused gate/up, down,
  lm_head) x M in ``--ms``: the W4A16 kernel, the W4A4 kernel (activation quantization included),
  XLA's bf16 ``dot`` on dense bf16 weights, and XLA on ``jnp.int4`` weights with bf16 scales
  (symmetric, group 128) dequantized inside the jit, for XLA to fuse as it can; the Mosaic W4A16
  kernel (``pallas_kernels.mgpu_matmul``) on the same codes in its tiles; tokamax's quantized
  ``ragged_dot`` with one group (a dense matmul; its Mosaic GPU kernel) on a qwix ``QArray`` of
  those codes and scales, where tokamax is installed (n/a otherwise; bf16 out). Input bf16
  ``[M, K]``, output f32 ``[M, N]``. GB/s on the bytes each call must move: its weights (+ scales)
  + activations + output. A configuration that does not lower or compile (a shape a kernel
  rejects) is recorded as n/a with the reason.

Timing: each configuration is one jitted call, compiled ahead of time (the Pallas ones in a pool of
``--threads``, then the XLA ones one at a time, so that their autotuning has the GPU to itself),
called once, then called R >= 16 times over distinct input buffers (weights rotated over copies
that together exceed twice the 60 MB L2). µs per call = the durations of every kernel of those R
calls (CUPTI trace via jax.profiler; one trace per shape, its configurations told apart by idle
gaps) / R; launch gaps are not included. Without a GPU (``--smoke``: tiny shapes in interpret
mode), or where a trace shows no kernels, host wall time instead (``timing`` in the json).

``--resume OLD.json`` starts from an earlier run's results: rows measured again replace theirs, the
others are kept, so the tables can be made by several GPU calls (e.g. split by ``--models``).
``--budget-s``: no shape or attention batch starts after that many seconds; skipped ones are logged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.args import command_line, git_commit, int_list, positive_int, positive_seconds, read_json
from bench.shapes import MODELS as SHAPES, linear_shapes
from pallas_kernels import gpu_matmul as gm
from pallas_kernels import mgpu_matmul
from pallas_kernels import reference as ref
from pallas_kernels.layout import QuantizedWeight, dequantize
from pallas_kernels.precision import W4A4, parse_precision

# decoder linears and lm_head of bench/shapes.py's models, (N, K) = (out_features, in_features); the
# 70B shape is measured only when --models names it
DEFAULT_MODELS = ("llama3-8b", "llama2-7b", "llama2-13b")
MODELS = {name: linear_shapes(cfg) for name, cfg in SHAPES.items() if name != "smoke"}
MS = (1, 4, 8, 16, 32, 64, 128, 256)
KINDS = ("w4a16", "w4a4", "xla_bf16", "xla_int4", "mosaic_w4a16", "tokamax_int4")
WEIGHT_OF = {"w4a16": "packed", "w4a4": "packed", "xla_bf16": "bf16", "xla_int4": "int4",
             "mosaic_w4a16": "int4_tiles", "tokamax_int4": "qarray"}
OUT_BYTES = {"tokamax_int4": 2}  # bytes per output element where a kind does not write float32
_L3 = SHAPES["llama3-8b"]
ATTN = {"heads": (_L3.num_heads, _L3.num_kv_heads, _L3.head_dim), "batches": (8, 16, 32, 64),
        "contexts": (1024, 2048, 4096, 8192), "ts": (1, 4), "shadow_bits": (8, 4)}
ATTN_MAX_BYTES = 40e9  # skip attention configurations whose buffers would exceed this
CHECK_CASES = [("o g128 sym", 4096, 4096, 128, True), ("o g32 asym", 4096, 4096, 32, False),
               ("down per-channel sym", 4096, 14336, 14336, True)]
PARTS = ("check", "attn", "table")  # in the order they run
SUMMARY_MS = (1, 16)
# Kernels a W4A16 / W4A4 call launches to prepare its activation input, by name: XLA's permutation into
# bf16 planes (gpu_matmul.activation_planes) and the quantize_rows prologue. In the model the RMSNorm /
# SwiGLU / attention-merge prologue before each matmul writes that input itself (gpu_activations), so the
# table also compares the two calls without them.
ACTIVATION_PREP = {"w4a16": "transpose", "w4a4": "_prologue_kernel"}
GROUP = 128  # the timed weights: symmetric, group 128
L2_BYTES = 60e6
CALLS = 16  # timed calls per configuration, at least
GAP_S = 0.03  # idle time after each configuration in a trace; events are split at gaps > GAP_S / 3
COPY_ELEMS = 1 << 30
KW: dict = {}  # extra keyword arguments for every kernel call ({"interpret": True} in --smoke)
MOSAIC_KW: dict = {}  # the Mosaic kernel's programs (--mosaic-programs)
ON_GPU = jax.default_backend() == "gpu"
Events = list[tuple[float, float, str]]  # (start_ns, duration_ns, kernel name)


def log(*a: Any) -> None:
    print(*a, flush=True)


def make_weight(key: jax.Array, n: int, k: int, group: int, symmetric: bool) -> QuantizedWeight:
    """Random packed INT4 weights (uniform codes, float16 scales, minimums when asymmetric)."""
    k1, k2, k3 = jax.random.split(key, 3)
    packed = jax.random.bits(k1, (n, k // 2), jnp.uint8)
    scales = jax.random.uniform(k2, (n, k // group), jnp.float32, 0.002, 0.02).astype(jnp.float16)
    mins = None if symmetric else (0.05 * jax.random.normal(k3, (n, k // group))).astype(jnp.float16)
    return QuantizedWeight(packed, scales, mins, group)


# ------------------------------------------------------------------------------------ timing

@dataclass
class Job:
    """One timed configuration: ``fn`` called on each of ``arg_sets`` (same shapes, other buffers)."""

    fn: Callable
    arg_sets: list
    pallas: bool  # compiled in the thread pool (the others one at a time, after it)
    compiled: Any = None
    error: str | None = None
    us: float | None = None
    kernels: dict = field(default_factory=dict)  # kernel name -> µs per call


def _reason(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _compile(jobs: list[Job], threads: int) -> None:
    """Lower every job here and compile the Pallas ones in a thread pool, then the others one at a
    time (XLA's autotuning times candidate kernels on the GPU: nothing else compiles meanwhile). A
    job whose lowering or compilation raises gets ``error`` instead."""
    pending = []
    with ThreadPoolExecutor(threads) as pool:
        for job in jobs:
            try:
                lowered = jax.jit(job.fn).lower(*job.arg_sets[0])
            except Exception as e:  # e.g. a shape the kernel's tiles do not fit
                job.error = _reason(e)
                continue
            pending.append((job, pool.submit(lowered.compile).result if job.pallas else lowered.compile))
    for job, get in pending:  # the pool's compiles are done here
        try:
            job.compiled = get()
        except Exception as e:
            job.error = _reason(e)


def _dispatch(job: Job) -> float:
    """Calls ``job`` on each argument set back to back; host seconds per call, to the last result."""
    t = time.perf_counter()
    jax.block_until_ready([job.compiled(*a) for a in job.arg_sets])
    return (time.perf_counter() - t) / len(job.arg_sets)


def _kernel_events(trace_dir: Path) -> Events:
    """Every event on the GPU stream lines of a trace, by start time."""
    from jax.profiler import ProfileData

    files = sorted(trace_dir.rglob("*.xplane.pb"))
    if not files:
        return []
    events = []
    for plane in ProfileData.from_file(str(files[-1])).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    return sorted(events)


def _split_at_gaps(events: Events) -> list[Events]:
    groups, end = [], -math.inf
    for ev in events:
        if ev[0] - end > GAP_S / 3 * 1e9:
            groups.append([])
        groups[-1].append(ev)
        end = max(end, ev[0] + ev[1])
    return groups


def _traced(jobs: list[Job], tmp: Path) -> list[Events]:
    """Kernel events of each job's calls: one trace, the jobs separated by idle time."""
    d = Path(tempfile.mkdtemp(dir=tmp))
    jax.profiler.start_trace(str(d))
    try:
        for job in jobs:
            _dispatch(job)
            time.sleep(GAP_S)
    finally:
        jax.profiler.stop_trace()
    return _split_at_gaps(_kernel_events(d))


def _set_time(job: Job, events: Events) -> None:
    calls = len(job.arg_sets)
    for _, dur, name in events:
        job.kernels[name[:80]] = job.kernels.get(name[:80], 0.0) + dur / 1e3 / calls
    job.kernels = {k: round(v, 3) for k, v in job.kernels.items()}
    job.us = sum(dur for _, dur, _ in events) / 1e3 / calls


def _kernel_groups(jobs: list[Job], tmp: Path) -> list[Events] | None:
    """Each job's kernel events (one trace for all, else one trace each), or None where a job has
    none."""
    groups = _traced(jobs, tmp)
    if len(groups) != len(jobs):
        log(f"trace: {len(groups)} idle-separated groups for {len(jobs)} configurations; tracing each alone")
        groups = [[ev for g in _traced([job], tmp) for ev in g] for job in jobs]
    if all(groups):
        return groups
    log("trace: no kernel events for some configurations; host wall time instead")
    return None


def measure(jobs: list[Job], tmp: Path, threads: int) -> None:
    """Compile, warm and time ``jobs``: sets their ``us`` and ``kernels``, or ``error``."""
    _compile(jobs, threads)
    for job in jobs:
        if job.error is None:
            try:
                jax.block_until_ready(job.compiled(*job.arg_sets[0]))
            except Exception as e:
                job.error = _reason(e)
    ok = [j for j in jobs if j.error is None]
    groups = _kernel_groups(ok, tmp) if ON_GPU and ok else None
    for i, job in enumerate(ok):
        if groups:
            _set_time(job, groups[i])
        else:
            job.us = _dispatch(job) * 1e6


def _result(job: Job, nbytes: int, bw: float) -> dict:
    if job.error is not None:
        return {"error": job.error}
    return {"us": job.us, "GBps": nbytes / job.us / 1e3, "pct_copy": 100 * nbytes / (job.us * 1e-6) / bw,
            "bytes": nbytes, "calls": len(job.arg_sets), "timing": "kernels" if job.kernels else "host wall",
            "kernels": job.kernels}


def _copies(nbytes: int) -> int:
    """Buffer copies to rotate over so that a buffer is out of L2 when it comes round again."""
    return max(2, math.ceil(2 * L2_BYTES / nbytes) + 1)


# ------------------------------------------------------------------------------------ parts

def copy_bandwidth(run: dict, tmp: Path, threads: int) -> None:
    """``a + 1`` over float32: bytes read + written per second of kernel time (wall on CPU)."""
    a = jax.random.normal(jax.random.key(0), (COPY_ELEMS,), jnp.float32)
    job = Job(lambda v: v + 1.0, [(a,)] * 5, pallas=False)
    measure([job], tmp, threads)
    run["copy_bw"] = 8 * COPY_ELEMS / (job.us * 1e-6)
    log(f"copy bandwidth: {run['copy_bw'] / 1e12:.2f} TB/s ({8 * COPY_ELEMS / 1e9:.2f} GB in {job.us:.1f} us; "
        f"{job.kernels})")


def check(res: dict, run_id: int, rng: np.random.Generator) -> None:
    """The kernels against the references on this device (see the module docstring)."""
    out = res["check"] = []
    res["check_run"] = run_id
    res.pop("check_ok", None)  # a run whose check stops early says nothing, not a resumed file's verdict
    ref_mm = jax.jit(ref.quantized_matmul, static_argnames="precision")
    j16 = jax.jit(lambda a, w: gm.w4a16_matmul(a, w, **KW))
    jax_ = jax.jit(lambda a, w, bits: gm.w4ax_matmul(a, w, bits, **KW), static_argnums=2)
    ok_all = True
    for ci, (name, n, k, g, sym) in enumerate(CHECK_CASES):
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
                r = np.asarray(ref_mm(xm, w, precision=parse_precision(mode)))
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
                r4 = np.asarray(ref_mm(xm, w, precision=W4A4))
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


def _dot_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` with a float32 result."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def xla_int4_matmul(x: jax.Array, w: tuple[jax.Array, jax.Array]) -> jax.Array:
    """``x @ (codes * scales).T`` for ``jnp.int4`` codes ``[N, K]`` and bf16 scales ``[N, K / GROUP]``,
    the dequantization written in jnp for XLA to fuse into its dot."""
    q, s = w
    n, k = q.shape
    wd = (q.astype(jnp.bfloat16).reshape(n, k // GROUP, GROUP) * s[:, :, None]).reshape(n, k)
    return _dot_t(x, wd)


def tokamax_int4_matmul(x: jax.Array, w: Any) -> jax.Array:
    """tokamax's ``ragged_dot`` of ``x`` with one group of INT4 weights (a qwix ``QArray`` ``[1, K, N]``,
    scales ``[1, K / GROUP, N]``), its Mosaic GPU implementation; bfloat16 out (its Hopper INT4 kernel
    refuses float32 out: an output tile of 64 columns must span one 128-byte swizzle)."""
    import tokamax

    return tokamax.ragged_dot(x, w, jnp.array([x.shape[0]], jnp.int32), preferred_element_type=jnp.bfloat16,
                              implementation="mosaic_gpu")


MATMULS = {
    "w4a16": lambda x, w: gm.w4a16_matmul(x, w, **KW),
    "w4a4": lambda x, w: gm.w4ax_matmul(x, w, 4, **KW),
    "xla_bf16": _dot_t,
    "xla_int4": xla_int4_matmul,
    "mosaic_w4a16": lambda x, w: mgpu_matmul.w4a16_int4_matmul(x, *w, **MOSAIC_KW),
    "tokamax_int4": tokamax_int4_matmul,
}


def _weight_bytes(family: str, n: int, k: int) -> int:
    return n * k * 2 if family == "bf16" else n * k // 2 + n * (k // GROUP) * 2


def _weight(family: str, n: int, k: int, seed: int) -> Any:
    key = jax.random.key(seed)
    if family == "packed":
        return make_weight(key, n, k, GROUP, True)
    if family == "bf16":
        return jax.random.normal(key, (n, k), jnp.bfloat16)
    k1, k2 = jax.random.split(key)
    codes = jax.random.randint(k1, (n, k), -8, 8, jnp.int8).astype(jnp.int4)
    scales = jax.random.uniform(k2, (n, k // GROUP), jnp.float32, 0.002, 0.02).astype(jnp.bfloat16)
    if family == "qarray":  # tokamax's operand (no qwix: the codes as they are, refused by the call)
        try:
            from qwix import QArray
        except ImportError:
            return codes, scales
        return QArray(codes.T[None], scales.T[None], qtype=jnp.int4)
    if family == "int4_tiles":  # the Mosaic kernel's operands; a shape without tiles stays as it is (refused)
        try:
            return mgpu_matmul.tile_codes(codes), scales.T
        except ValueError:
            return codes, scales.T
    return codes, scales


def _matmul_jobs(n: int, k: int, ms: tuple[int, ...], kinds: tuple[str, ...]) -> dict[tuple[int, str], Job]:
    """A job per (M, kind) for one weight shape; the weights of each family rotated over copies."""
    families = sorted({WEIGHT_OF[kind] for kind in kinds})
    copies = {f: _copies(_weight_bytes(f, n, k)) for f in families}
    weights = {f: [_weight(f, n, k, 10 + c) for c in range(copies[f])] for f in families}
    calls = max(CALLS, *copies.values())
    jobs = {}
    for m in ms:
        xs = [jax.random.normal(jax.random.key(1000 + i), (m, k), jnp.bfloat16) for i in range(calls)]
        for kind in kinds:
            ws = weights[WEIGHT_OF[kind]]
            sets = [(xs[i], ws[i % len(ws)]) for i in range(calls)]
            jobs[m, kind] = Job(MATMULS[kind], sets, pallas=kind.startswith(("w4", "mosaic")))
    return jobs


def _matmul_bytes(kind: str, m: int, n: int, k: int) -> int:
    return _weight_bytes(WEIGHT_OF[kind], n, k) + m * k * 2 + m * n * OUT_BYTES.get(kind, 4)


def matmul_table(res: dict, run_id: int, models: list[str], ms: tuple[int, ...], kinds: tuple[str, ...], tmp: Path,
                 threads: int, deadline: float, save: Callable[[], None]) -> None:
    """The ``table`` part: rows ``res["table"]["model/shape/M"]`` of ``kinds``' entries (a row measured again
    replaces the old one), saved after each shape."""
    bw = res["runs"][run_id]["copy_bw"]
    for model in models:
        for shape, (n, k) in MODELS[model].items():
            if time.time() > deadline:
                log(f"time budget: {model} {shape} not run")
                continue
            t = time.time()
            jobs = _matmul_jobs(n, k, ms, kinds)
            measure(list(jobs.values()), tmp, threads)
            for m in ms:
                row = {"model": model, "shape": shape, "N": n, "K": k, "M": m, "run": run_id}
                row.update({kind: _result(jobs[m, kind], _matmul_bytes(kind, m, n, k), bw) for kind in kinds})
                res["table"][f"{model}/{shape}/{m}"] = row
                log(f"{model} {shape} {n}x{k} M={m}: "
                    + ", ".join(f"{kind} {_us(row[kind])} us ({_pct(row[kind])})" for kind in kinds))
            del jobs
            save()
            log(f"[{model} {shape}: {time.time() - t:.0f}s]")


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array) -> jax.Array:
    """:func:`reference.attention` with slot ``s`` holding position ``s``."""
    b, s = k.shape[:2]
    return ref.attention(q, k, v, q_pos, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)))


def _attention_kernel() -> tuple[Callable | None, str | None]:
    """(the kernel, None), or (None, why not)."""
    try:
        from pallas_kernels import gpu_attention
    except ImportError as e:
        log(f"attn: no kernel ({e}); XLA alone is timed")
        return None, _reason(e)
    return (lambda *args: attention_call(*args, **KW)), None


def attention_call(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, *scales: jax.Array, **kw) -> jax.Array:
    """The decode attention kernel on one of :func:`_attn_inputs`' argument sets: ``(q, k, v, q_pos)``
    over the bf16 cache, the key and value scales appended over a shadow; ``kw`` its tiles."""
    from pallas_kernels import gpu_attention

    return gpu_attention.decode_attention(q, k, v, q_pos, scales=tuple(scales) or None, **kw)


def _kv_bytes(b: int, ctx: int, bits: int = 16) -> int:
    """K + V cache bytes of one layer: bf16 (``bits`` 16), or the draft's shadow (codes and a float32
    scale per key / value vector)."""
    _, kvh, d = ATTN["heads"]
    return 2 * b * ctx * kvh * (d * bits // 8 + (4 if bits < 16 else 0))


def _attn_bytes(b: int, ctx: int, t: int, bits: int = 16) -> tuple[int, int]:
    """(bytes a call must move: the cache of ``bits`` + q + output, bf16; device bytes of the
    configuration: its bf16 and shadow cache copies plus XLA's float32 score-sized intermediates,
    ~4 of them)."""
    h, _, d = ATTN["heads"]
    held = sum(_copies(_kv_bytes(b, ctx, s)) * _kv_bytes(b, ctx, s) for s in (16, *ATTN["shadow_bits"]))
    return _kv_bytes(b, ctx, bits) + 2 * b * t * h * d * 2, held + 4 * b * h * t * ctx * 4


def _attn_inputs(b: int, ctx: int, ts, cache_bits=None) -> dict[tuple[int, int], list[tuple]]:
    """Per (T, cache bits of ``cache_bits``, default all): argument sets ``(q, k, v, q_pos)`` of one
    (batch, context) over the bf16 cache (bits 16), ``(q, k_words, v_words, q_pos, k_scales,
    v_scales)`` over its INT8 / INT4 shadow (scales head-major ``[B, KV, S]``); each cache rotated
    over enough copies of its own size to leave L2 (copy c of a shadow quantizes bf16 copy c, so the
    first sets hold the same values), the T queries at the cache's last positions."""
    h, kvh, d = ATTN["heads"]
    cache_bits = (16, *ATTN["shadow_bits"]) if cache_bits is None else cache_bits

    def bf16_pair(c: int) -> tuple[jax.Array, jax.Array]:
        return tuple(jax.random.normal(jax.random.key(2 * c + i), (b, ctx, kvh, d), jnp.bfloat16) for i in range(2))

    caches = {bits: [] for bits in cache_bits}
    for c in range(max(_copies(_kv_bytes(b, ctx, bits)) for bits in cache_bits)):
        k, v = bf16_pair(c)
        for bits in cache_bits:
            if c >= _copies(_kv_bytes(b, ctx, bits)):
                continue
            if bits == 16:
                caches[16].append((k, v))
            else:
                (kw, ks), (vw, vs) = ref.quantize_kv(k, bits), ref.quantize_kv(v, bits)
                caches[bits].append((kw, vw, jnp.swapaxes(ks, -1, -2), jnp.swapaxes(vs, -1, -2)))
    calls = max(CALLS, *(len(c) for c in caches.values()))
    out = {}
    for t in ts:
        q = jax.random.normal(jax.random.key(99), (b, t, h, d), jnp.bfloat16)
        q_pos = jnp.broadcast_to(ctx - t + jnp.arange(t, dtype=jnp.int32), (b, t))
        for bits, copies in caches.items():
            out[t, bits] = [(q, *c[:2], q_pos, *c[2:]) for c in (copies[i % len(copies)] for i in range(calls))]
    return out


def _attn_jobs(b: int, kernel: Callable | None) -> dict[tuple[int, int, str], Job]:
    """Jobs ``(context, T, "xla" | "kernel" | "kv8" | "kv4")`` for one batch size (the last two: the
    kernel over the shadow); caches rotated over copies."""
    jobs = {}
    for ctx in ATTN["contexts"]:
        if max(_attn_bytes(b, ctx, t)[1] for t in ATTN["ts"]) > ATTN_MAX_BYTES:
            log(f"attn B={b} context {ctx}: over {ATTN_MAX_BYTES / 1e9:.0f} GB, skipped")
            continue
        cache_bits = None if kernel is not None else (16,)  # without the kernel: XLA's bf16 alone
        for (t, bits), sets in _attn_inputs(b, ctx, ATTN["ts"], cache_bits).items():
            if bits == 16:
                jobs[ctx, t, "xla"] = Job(xla_attention, sets, pallas=False)
            if kernel is not None:
                jobs[ctx, t, "kernel" if bits == 16 else f"kv{bits}"] = Job(kernel, sets, pallas=True)
    return jobs


def _shadow_rel_diff(job: Job, bits: int) -> float | None:
    """max |kernel - XLA| / max |XLA| on the first set of a shadow job, XLA attending over the
    shadow's dequantized cache (:func:`pallas_kernels.reference.dequantize_kv`): the kernel's own
    error (float16 queries and probabilities), not the quantization's."""
    if job.error is not None:
        return None
    q, kw, vw, q_pos, ks, vs = job.arg_sets[0]
    deq = lambda w, s: ref.dequantize_kv(w, jnp.swapaxes(s, -1, -2), bits)  # noqa: E731
    r = jax.jit(xla_attention)(q.astype(jnp.float32), deq(kw, ks), deq(vw, vs), q_pos)
    return _rel_diff(job, r)


def _max_rel_diff(job: Job, base: Job) -> float | None:
    if job.error is not None or base.error is not None:
        return None
    return _rel_diff(job, base.compiled(*base.arg_sets[0]))


def _rel_diff(job: Job, r) -> float:
    """max |job's output - r| / max |r| on the job's first argument set."""
    y, r = np.asarray(job.compiled(*job.arg_sets[0]), np.float32), np.asarray(r, np.float32)
    return float(np.abs(y - r).max() / np.abs(r).max())


def attention_table(res: dict, run_id: int, tmp: Path, threads: int, deadline: float,
                    save: Callable[[], None]) -> None:
    """The ``attn`` part: rows ``res["attn"]["B/context/T"]``, saved after each batch size."""
    bw = res["runs"][run_id]["copy_bw"]
    kernel, missing = _attention_kernel()
    for b in ATTN["batches"]:
        if time.time() > deadline:
            log(f"time budget: attention batch {b} not run")
            continue
        jobs = _attn_jobs(b, kernel)
        measure(list(jobs.values()), tmp, threads)
        for ctx, t in [(c, t) for c, t, impl in jobs if impl == "xla"]:
            nbytes = _attn_bytes(b, ctx, t)[0]
            xla, kern = jobs[ctx, t, "xla"], jobs.get((ctx, t, "kernel"))
            row = {"B": b, "context": ctx, "T": t, "run": run_id, "floor_us": nbytes / bw * 1e6,
                   "kernel": _result(kern, nbytes, bw) if kern else {"error": missing},
                   "xla": _result(xla, nbytes, bw),
                   "max_rel_diff": _max_rel_diff(kern, xla) if kern else None, "shadow": {}}
            for bits in ATTN["shadow_bits"] if kern else ():
                job, sbytes = jobs[ctx, t, f"kv{bits}"], _attn_bytes(b, ctx, t, bits)[0]
                row["shadow"][str(bits)] = {"floor_us": sbytes / bw * 1e6, **_result(job, sbytes, bw),
                                            "max_rel_diff": _shadow_rel_diff(job, bits)}
            res["attn"][f"{b}/{ctx}/{t}"] = row
            log(f"attn B={b} context {ctx} T={t}: kernel {_us(row['kernel'])} us, XLA {_us(row['xla'])} us, "
                f"floor {row['floor_us']:.1f} us, max rel diff {row['max_rel_diff']}; "
                + ", ".join(f"INT{bits} shadow {_shadow(e)}" for bits, e in row["shadow"].items()))
        del jobs
        save()


# ------------------------------------------------------------------------------------ report

def _us(e: dict) -> str:
    return "n/a" if "error" in e else f"{e['us']:.1f}"


def _pct(e: dict) -> str:
    return "n/a" if "error" in e else f"{e['pct_copy']:.0f}%"


def _ratio(num: dict, den: dict) -> str:
    """``num``'s time / ``den``'s time: how many times faster ``den`` is."""
    return "n/a" if "error" in num or "error" in den else f"{num['us'] / den['us']:.2f}×"


def without_prep(e: dict, kind: str) -> dict:
    """Entry ``e`` of a ``kind`` call ("w4a16" or "w4a4") less its :data:`ACTIVATION_PREP` kernels
    (``us`` only), or an error where its timing has no such kernel (host wall time: no breakdown)."""
    if "error" in e:
        return e
    kernels = e.get("kernels") or {}
    prep = [name for name in kernels if ACTIVATION_PREP[kind] in name]
    if not prep:
        return {"error": "no per-kernel times"}
    return {"us": e["us"] - sum(kernels[name] for name in prep)}


def _entry(row: dict, kind: str) -> dict:
    """A table row's entry for ``kind`` (rows recorded before a kind was added have none)."""
    return row.get(kind, {"error": "not measured"})


def _model_table(rows: list[dict]) -> list[str]:
    names = {"w4a16": "W4A16", "w4a4": "W4A4", "xla_bf16": "XLA bf16", "xla_int4": "XLA int4",
             "mosaic_w4a16": "Mosaic W4A16", "tokamax_int4": "tokamax int4"}
    head = ([f"{names[kind]} µs" for kind in KINDS] + [f"{names[kind]} %BW" for kind in KINDS]
            + ["W4A16 vs XLA bf16", "W4A16 vs XLA int4", "W4A4 vs W4A16", "W4A4 vs W4A16, input prep excluded",
               "Mosaic W4A16 vs W4A16", "tokamax int4 vs W4A16"])
    lines = ["| shape (N×K) | M | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    notes: dict[str, list[str]] = {}
    for r in rows:
        e = {kind: _entry(r, kind) for kind in KINDS}
        lines.append(f"| {r['shape']} {r['N']}×{r['K']} | {r['M']} | "
                     + " | ".join(_us(e[kind]) for kind in KINDS) + " | "
                     + " | ".join(_pct(e[kind]) for kind in KINDS) + " | "
                     + f"{_ratio(e['xla_bf16'], e['w4a16'])} | {_ratio(e['xla_int4'], e['w4a16'])} | "
                     + f"{_ratio(e['w4a16'], e['w4a4'])} | "
                     + f"{_ratio(without_prep(e['w4a16'], 'w4a16'), without_prep(e['w4a4'], 'w4a4'))} | "
                     + f"{_ratio(e['w4a16'], e['mosaic_w4a16'])} | {_ratio(e['w4a16'], e['tokamax_int4'])} |")
        for kind in KINDS:
            if "error" in e[kind]:
                notes.setdefault(f"{kind} {r['shape']}: {e[kind]['error']}", []).append(str(r["M"]))
    notes_md = [f"- n/a: {note} (M = {', '.join(ms)})" for note, ms in notes.items()]
    int4_kernels = sorted({name for r in rows for name in _entry(r, "xla_int4").get("kernels", {})})
    if int4_kernels:
        notes_md.append("- kernels of the XLA int4 calls: " + ", ".join(f"`{n}`" for n in int4_kernels))
    return lines + ([""] + notes_md if notes_md else [])


def _shadow(e: dict | None) -> str:
    """A shadow cell: µs (× its own floor), or why not; "–" for rows measured before shadows were."""
    if e is None:
        return "–"
    return _us(e) if "error" in e else f"{e['us']:.1f} ({e['us'] / e['floor_us']:.2f}×)"


def _attn_row(r: dict) -> str:
    k, x = r["kernel"], r["xla"]
    gbps = "n/a" if "error" in k else f"{k['GBps']:.0f}"
    floor = "n/a" if "error" in k else f"{k['us'] / r['floor_us']:.2f}×"
    diff = "–" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.1e}"
    shadows = " | ".join(_shadow(r.get("shadow", {}).get(str(bits))) for bits in ATTN["shadow_bits"])
    return (f"| {r['B']} | {r['context']} | {r['T']} | {_us(k)} | {gbps} | {r['floor_us']:.1f} | {floor} | "
            f"{_us(x)} | {_ratio(x, k)} | {diff} | {shadows} |")


def _attn_table(rows: list[dict]) -> list[str]:
    shadows = "".join(f" INT{bits} shadow µs (× its floor) |" for bits in ATTN["shadow_bits"])
    lines = ["| batch | context | T | kernel µs | kernel GB/s | floor µs | kernel / floor | XLA µs | "
             "XLA / kernel | max rel diff |" + shadows, "|" + "---|" * (10 + len(ATTN["shadow_bits"]))]
    lines += [_attn_row(r) for r in rows]
    errors = sorted({r["kernel"]["error"] for r in rows if "error" in r["kernel"]})
    return lines + ([""] + [f"- kernel n/a: {e}" for e in errors] if errors else [])


def _run_line(run: dict) -> str:
    bw = f"{run['copy_bw'] / 1e12:.2f} TB/s" if "copy_bw" in run else "not measured"
    return (f"`{run['command']}`  \ncopy bandwidth {bw} (f32 `a + 1`, read + write, by {run['timing']}); "
            f"{run['device']}, jax {run['jax']}, {run['date']}; parts: {', '.join(run['parts'])}"
            + (f"; models: {', '.join(run['models'])}" if "table" in run["parts"] else "")
            + (f"; kinds: {', '.join(run['kinds'])}" if "table" in run["parts"] and "kinds" in run else ""))


def markdown(res: dict) -> str:
    """kernels.md: the command line(s) and copy bandwidth(s), then one table per model, attention,
    and the check's verdict."""
    lines = [f"{i + 1}. " + _run_line(run) + "\n" for i, run in enumerate(res["runs"])]
    runs_of = lambda rows: ", ".join(str(v + 1) for v in sorted({r["run"] for r in rows}))  # noqa: E731
    lines += ["µs: time per call = durations of all the kernels the call launches (CUPTI trace; host wall "
              "time where the run says so), averaged over R calls on distinct buffers (R = `calls` in "
              "kernels.json, 16+; weights rotated over copies > 2× L2). %BW: bytes the call must move "
              "(weights: 0.5 B each + one 2-byte scale per 128 for INT4, 2 B for bf16; bf16 activations; "
              "f32 output) / µs / the copy bandwidth of its run. Speed-ups are time ratios: \"A vs B\" = "
              "B's µs / A's µs (> 1: A faster). W4A4 includes its activation-quantization kernel and W4A16 the XLA "
              "permutation of its activations into planes; \"input prep excluded\" compares the two calls "
              "without these (CUPTI's per-kernel times, in kernels.json), as the model runs them: there the "
              "RMSNorm / SwiGLU / attention-merge prologue before each matmul writes its input. XLA "
              "int4: `jnp.int4` codes × bf16 group-128 scales, dequantized inside the jit; XLA fuses it as "
              "it chooses.", ""]
    models: dict[str, list[dict]] = {}
    for r in res["table"].values():
        models.setdefault(r["model"], []).append(r)
    for model, rows in models.items():
        lines += [f"## {model}", "", f"Measured by run {runs_of(rows)}.", ""] + _model_table(rows) + [""]
    if res["attn"]:
        h, kvh, d = ATTN["heads"]
        lines += ["## Decode attention", "", f"H {h}, KV {kvh}, d {d}, bf16; the cache holds the context, "
                  "all visible. Floor: (K + V + q + output bytes) / copy bandwidth. Max rel diff: "
                  "max |kernel - XLA| / max |XLA|. INT8 / INT4 shadow: the same kernel over the draft's "
                  "quantized copy of that cache, against its own floor (codes + float32 scales + q + output); "
                  "its max rel diff (kernels.json) to XLA over the dequantized shadow. "
                  f"Measured by run {runs_of(res['attn'].values())}.", ""] + _attn_table(list(res["attn"].values())) + [""]
    if "check_ok" in res:
        lines.append(f"GPU correctness checks (`check`, {len(res['check'])} rows in kernels.json): "
                     f"{'PASSED' if res['check_ok'] else 'FAILED'}")
    return "\n".join(lines)


def summary(res: dict) -> str:
    """A short fixed-width table: matmuls at M in SUMMARY_MS, attention at T=1, the check."""
    head = ("model", "shape", "M", "W4A16 us", "%BW", "W4A4 us", "bf16 us", "int4 us", "vs bf16", "vs int4")
    fmt = "{:11s} {:8s} {:>4} {:>9} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8}"
    lines = [fmt.format(*head)] if res["table"] else []
    for r in res["table"].values():
        if r["M"] in SUMMARY_MS:
            e = {kind: _entry(r, kind) for kind in KINDS}
            lines.append(fmt.format(r["model"], r["shape"], r["M"], _us(e["w4a16"]), _pct(e["w4a16"]),
                                    _us(e["w4a4"]), _us(e["xla_bf16"]), _us(e["xla_int4"]),
                                    _ratio(e["xla_bf16"], e["w4a16"]), _ratio(e["xla_int4"], e["w4a16"])))
    afmt = "attn B={:<3} ctx={:<5} T=1: kernel {:>7} us, {:>6} x floor, XLA {:>7} us ({} vs kernel); shadows {}"
    for r in res["attn"].values():
        if r["T"] == 1:
            k = r["kernel"]
            floor = "n/a" if "error" in k else f"{k['us'] / r['floor_us']:.2f}"
            shadows = ", ".join(f"INT{b} {_shadow(e)}" for b, e in r.get("shadow", {}).items()) or "–"
            lines.append(afmt.format(r["B"], r["context"], _us(k), floor, _us(r["xla"]), _ratio(r["xla"], k),
                                     shadows))
    if "check_ok" in res:
        lines.append(f"GPU correctness checks: {'PASSED' if res['check_ok'] else 'FAILED'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ main

def _smoke() -> None:
    """Tiny shapes (one a kernel rejects: N=40) in interpret mode: a CPU check of this script."""
    global MODELS, DEFAULT_MODELS, MS, CHECK_CASES, ATTN, L2_BYTES, CALLS, COPY_ELEMS
    MODELS, DEFAULT_MODELS = {"tiny": {"a": (32, 256), "odd": (40, 256)}}, ("tiny",)
    MS = (16,)
    CHECK_CASES = [("tiny g32 asym", 32, 256, 32, False), ("tiny per-channel", 32, 256, 256, True)]
    ATTN = {"heads": (4, 2, 64), "batches": (2,), "contexts": (128,), "ts": (1, 4), "shadow_bits": (8, 4)}
    L2_BYTES, CALLS, COPY_ELEMS = 1e3, 2, 1 << 20
    KW["interpret"] = True


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--models", default=None,
                    help=f"comma-separated, of {tuple(MODELS)} (default {','.join(DEFAULT_MODELS)})")
    ap.add_argument("--ms", type=int_list(), default=None, help=f"row counts (default {','.join(map(str, MS))})")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"the table's matmuls, comma-separated, of {KINDS}")
    ap.add_argument("--mosaic-programs", type=positive_int, default=None,
                    help="the Mosaic kernel's programs, which fix its K cuts (default: one per SM)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    ap.add_argument("--resume", type=Path, default=None, help="an earlier kernels.json to merge into")
    ap.add_argument("--budget-s", type=positive_seconds, default=480.0, help="start no shape / batch after this")
    ap.add_argument("--threads", type=positive_int, default=min(8, os.cpu_count() or 1),
                    help="Pallas compiles at once")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes in interpret mode (CPU check of this script)")
    ap.add_argument("--row-tiles", type=int, default=None,
                    help=f"row tiles (gpu_matmul.TILE_HEIGHTS rows each) per matmul program "
                         f"(default gpu_matmul.ROW_TILES = {gm.ROW_TILES})")
    args = ap.parse_args(argv)
    if args.row_tiles is not None:
        if not 1 <= args.row_tiles <= 4:
            ap.error("--row-tiles must be 1..4 (shared memory)")
        gm.ROW_TILES = args.row_tiles
    if args.smoke:
        _smoke()
    if args.mosaic_programs is not None:
        MOSAIC_KW["programs"] = args.mosaic_programs
    args.parts = [p for p in args.parts.split(",") if p]
    if not args.parts:
        ap.error(f"--parts: give at least one of {PARTS}")
    args.models = args.models.split(",") if args.models else list(DEFAULT_MODELS)
    args.ms = tuple(args.ms) if args.ms else MS
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds:
        ap.error(f"--kinds: give at least one of {KINDS}")
    for name, got, known in (("part", args.parts, PARTS), ("model", args.models, MODELS), ("kind", kinds, KINDS)):
        if set(got) - set(known):
            ap.error(f"unknown {name}(s) {sorted(set(got) - set(known))}; known: {', '.join(known)}")
    args.kinds = tuple(k for k in KINDS if k in kinds)  # in the table's order
    return args


def prune_runs(res: dict) -> None:
    """Drop the earlier runs that no table row or check refers to any more (a resumed file's rows all
    measured again), renumbering the references to the runs kept; the last run stays (its errors)."""
    rows = [*res["table"].values(), *res["attn"].values()]
    check = {res.get("check_run", 0)} if "check" in res else set()  # files before check_run: the first run's
    used = sorted({r["run"] for r in rows} | check | {len(res["runs"]) - 1})
    new = {old: i for i, old in enumerate(used)}
    res["runs"] = [res["runs"][i] for i in used]
    for r in rows:
        r["run"] = new[r["run"]]
    if "check_run" in res:
        res["check_run"] = new[res["check_run"]]


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    args = _args(argv)
    seed = int.from_bytes(os.urandom(4), "little")
    layout = {"runs": list, "table": dict, "attn": dict}
    res = {"runs": [], "table": {}, "attn": {}} | (read_json(args.resume, "--resume", layout) if args.resume else {})
    run = {"command": "PYTHONPATH=. " + command_line("bench.kernels", argv),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": jax.devices()[0].device_kind, "commit": git_commit(), "jax": jax.__version__, "seed": seed,
           "parts": args.parts, "models": args.models, "kinds": list(args.kinds),
           "timing": "GPU kernel time (CUPTI)" if ON_GPU else "host wall time"}
    res["runs"].append(run)
    run_id = len(res["runs"]) - 1
    log(f"devices: {jax.devices()}  jax {jax.__version__}  seed {seed}")
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / "kernels.json").write_text(json.dumps(res, indent=1))

    deadline = t0 + args.budget_s
    with tempfile.TemporaryDirectory(prefix="kernels_trace") as tmp_dir:
        tmp = Path(tmp_dir)
        if {"attn", "table"} & set(args.parts):
            copy_bandwidth(run, tmp, args.threads)
        steps = {"check": lambda: check(res, run_id, np.random.default_rng(seed)),
                 "attn": lambda: attention_table(res, run_id, tmp, args.threads, deadline, save),
                 "table": lambda: matmul_table(res, run_id, args.models, args.ms, args.kinds, tmp, args.threads,
                                               deadline, save)}
        for name in [p for p in PARTS if p in args.parts]:
            t = time.time()
            try:
                steps[name]()
            except Exception:
                log(f"part {name} FAILED:\n{traceback.format_exc()}")
                run.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            log(f"[{name} took {time.time() - t:.0f}s]")
            save()
    prune_runs(res)
    save()
    (args.out / "kernels.md").write_text(markdown(res) + "\n")
    log(f"wrote {args.out / 'kernels.md'} and kernels.json ({time.time() - t0:.0f}s in all)")
    log("\n" + summary(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
