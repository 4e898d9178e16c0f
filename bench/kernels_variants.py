"""W4A16 kernel (version 2) on the GPU: correctness + row-count invariance, then timing, for the
default configuration or (``--all``) the variants compared on 2026-11-30. Run from the repo root:

    PYTHONPATH=. python3 -m bench.kernels_variants [--all] [--budget-s 85]

Check: ``bench.kernels.CHECK_CASES`` (o g128 sym, o g32 asym, down per-channel), M = 1, 16, 64:
relative error vs float64 on the host (< 1e-2) and rows 0, 1, 3 of M=1 calls bitwise equal to the
same rows inside the M = 16, 64 calls. Timing: as in bench/kernels.py (GPU time = sum of kernel
durations in a CUPTI trace of one jit of 32+ calls over rotated weight copies; group 128,
symmetric); % of the 4.28 TB/s copy bandwidth measured by bench.kernels the same day. Writes
``variants.json`` under ``$OUT`` (default /tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernels as bk
from pallas_kernels import gpu_matmul as gm
from pallas_kernels.layout import dequantize

COPY_BW = 4.28e12  # bench.kernels copy bandwidth on the H200, 2026-11-30
V = {  # name -> w4a16_matmul keyword arguments (None entries: the defaults)
    "default": {},
    "p2_split": dict(phases=2, x_split=True),
    "p8_strided": dict(phases=8, x_split=False),
    "p8_split": dict(phases=8, x_split=True),
    "p8_split_bm64": dict(phases=8, x_split=True, block_m=64),
}
SHAPES = ("o", "gate_up", "down", "qkv")


def configs(all_variants: bool):
    """(shape, variant, block_n, block_k, block_m, Ms); None = default."""
    if not all_variants:
        return [(s, "default", None, None, None, (1, 16, 64)) for s in SHAPES]
    out = []
    for s in SHAPES:
        out += [(s, "p2_split", 64, 256, 16, (1, 64)), (s, "p8_strided", 64, 256, 16, (1, 16, 64)),
                (s, "p8_split", 64, 256, 16, (1, 16, 64)), (s, "p8_split", 64, 512, 16, (1,)),
                (s, "p8_split", 128, 256, 16, (1,)), (s, "p8_split", 64, 256, 64, (1, 64))]
    return out


def check(res, variants, log):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    ok_all = True
    for name, n, k, g, sym in bk.CHECK_CASES:
        w = bk.make_weight(jax.random.key(7), n, k, g, sym)
        xh = rng.standard_normal((64, k)) * np.exp(rng.standard_normal((64, 1)))
        x = jnp.asarray(xh.astype(np.float32))
        exact = np.asarray(x, np.float64) @ np.asarray(dequantize(w, jnp.float32), np.float64).T
        for vn in variants:
            f = jax.jit(lambda a, w, kw=V[vn]: gm.w4a16_matmul(a, w, **kw))
            alone = np.stack([np.asarray(f(x[i:i + 1], w))[0] for i in (0, 1, 3)])
            row = {"case": name, "variant": vn}
            for m in (1, 16, 64):
                y = np.asarray(f(x[:m], w))
                e = float(np.linalg.norm(y - exact[:m]) / np.linalg.norm(exact[:m]))
                rows = [j for j, i in enumerate((0, 1, 3)) if i < m]
                inv = bool(np.array_equal(y[[(0, 1, 3)[j] for j in rows]], alone[rows]))
                row[f"M{m}"] = (round(e, 5), inv)
                ok_all &= (e < 1e-2) and inv and bool(np.isfinite(y).all())
            res["check"].append(row)
            log("check", json.dumps(row))
    res["check_ok"] = ok_all
    log("CHECK", "PASSED" if ok_all else "FAILED")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="the variant comparison instead of the default only")
    ap.add_argument("--budget-s", type=float, default=85.0, help="stop timing after this many seconds")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT") or "/tmp")
    log = bk.log
    res = {"check": [], "time": []}
    tmp = Path(tempfile.mkdtemp())
    t0 = time.time()
    check(res, ["p2_split", "p8_strided", "p8_split", "p8_split_bm64"] if args.all else ["default"], log)
    cur = None
    for s, vn, bn, bkk, bm, ms in configs(args.all):
        if time.time() - t0 > args.budget_s:
            log("budget reached")
            break
        n, k = bk.SHAPES[s]
        if cur != s:
            ws = bk._weights(n, k, bk.GROUP, True, bk.weight_bytes(n, k, bk.GROUP, True), 10)
            calls = max(bk.CALLS, len(ws))
            xs = {m: bk._xs(m, k, calls, jnp.bfloat16) for m in (1, 16, 64)}
            cur = s
        kw = dict(V[vn], block_n=bn, block_k=bkk, block_m=bm)
        bn, bkk, split = gm.default_config(n, k, bk.GROUP, "w4a16", bn, bkk)
        bm = bm or gm.w4a16_launch(n, k, bk.GROUP)[0]
        fn = lambda x, w, kw=kw: gm.w4a16_matmul(x, w, **kw)
        for m in ms:
            sets = [(xs[m][i], ws[i % len(ws)]) for i in range(calls)]
            try:
                med, lo, hi, cs = bk.time_calls(fn, sets, 5)
                gpu, kern = bk.gpu_time(fn, sets, tmp)
            except Exception as e:  # a config Triton rejects: log it and go on
                log(f"time {s} {vn} {bn} {bkk} {bm} M={m}: FAILED {type(e).__name__}: {str(e)[:400]}")
                break
            nb = bk._bytes("w4a16", m, n, k)
            r = {"shape": s, "variant": vn, "bn": bn, "bk": bkk, "bm": bm, "split": split, "M": m, "us": gpu,
                 "wall_us": med * 1e6, "pct": 100 * nb / (gpu * 1e-6) / COPY_BW, "kernels": kern}
            res["time"].append(r)
            log(f"time {s:8s} {vn:11s} bn={bn:3d} bk={bkk} bm={bm:2d} split={split} M={m:2d}: gpu {gpu:7.2f} us "
                f"({r['pct']:.0f}%) wall {med * 1e6:7.2f} {kern}")
        (out_dir / "variants.json").write_text(json.dumps(res, indent=1))
    (out_dir / "variants.json").write_text(json.dumps(res, indent=1))
    log(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
