"""Tile and launch sweep of the Pallas matmuls on the GPU: which tiles the defaults should be.

    PYTHONPATH=. python3 -m bench.tune [--shapes qkv,o,gate_up,down,lm_head] [--kinds w4a16,w4a8,dense]
        [--models llama3-8b,llama2-7b,llama2-13b] [--ms 16,32,64,128,256] [--attn 8,16:1024,2048]
        [--attn-kv 16,8,4] [--attn-heads 32,8,128] [--prologue 1,16,64] [--prologue-kinds swiglu_planes]
        [--only rows_first] [--out DIR] [--budget-s 400]

Layer shapes of ``--models`` (default Llama-3-8B; :data:`bench.kernels.MODELS`). For each (shape, kind,
M) the kernel with its default tiles and a set of variants (:func:`variants`: warps, pipeline stages,
weight tile, K chunk, K split at small M; rows per tile 64 / 128 x warps x stages at larger M; the
tokens and weights on the other MMA sides) are timed the way
:mod:`bench.kernels` times them (CUPTI kernel time per call, weights rotated out of L2). Each
variant's output on the first input is compared with the default's: ``same bits`` when identical,
else the max relative difference (a K chunk, split or weight tile other than the default changes the
summation order; rows per tile, warps and stages must not change a bit). Writes ``tune.json`` / ``tune.md``
under ``--out`` (default ``$OUT``, else bench/results) after every shape. ``--attn`` also sweeps
the decode attention kernel's KV block, cache splits and warps (``--shapes ''`` for attention alone;
the heads of ``--attn-heads``, default Llama-3-8B's), over the bf16 cache or (``--attn-kv``) the
draft's INT8 / INT4 shadow of it, where pipeline stages are swept too; ``--prologue`` the
activation-prologue kernels' (``--prologue-kinds``) tile width and spread
(:mod:`pallas_kernels.gpu_activations`) at the hidden and intermediate widths of all three model shapes.
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

from bench.args import command_line, int_list, positive_int, positive_seconds
from bench.kernels import (ATTN, CALLS, GROUP, MODELS, Job, _attn_bytes, _attn_inputs, _copies, _max_rel_diff, _weight,
                           _weight_bytes, attention_call, copy_bandwidth, log, measure)
from pallas_kernels import gpu_activations, gpu_attention, gpu_matmul as gm

KINDS = {
    "w4a16": lambda x, w, kw: gm.w4a16_matmul(x, w, **kw),
    "w4a8": lambda x, w, kw: gm.w4ax_matmul(x, w, 8, **kw),
    "dense": lambda x, w, kw: gm.dense_matmul(x, w, **kw),
}
PROLOGUES = {  # the activation-prologue kernels, on x [M, K] (SwiGLU: [M, 2K]) and an RMSNorm scale [K]
    "quantize": lambda x, s, kw: gpu_activations.quantize_rows(x, 8, **kw),
    "norm_quantize": lambda x, s, kw: gpu_activations.rms_norm_quantize(x, s, 1e-5, 8, **kw),
    "norm_planes": lambda x, s, kw: gpu_activations.rms_norm_planes(x, s, 1e-5, **kw),
    "swiglu_quantize": lambda x, s, kw: gpu_activations.swiglu_quantize(x, 8, **kw),
    "swiglu_quantize_one": lambda x, s, kw: gpu_activations.swiglu_quantize(x, 8, spread=False, **kw),
    "swiglu_planes": lambda x, s, kw: gpu_activations.swiglu_planes(x, **kw),
    "swiglu_planes_one": lambda x, s, kw: gpu_activations.swiglu_planes(x, spread=False, **kw),
}
PROLOGUE_DEFAULT_BLOCKS = {kind: gpu_activations.SPREAD_BLOCKS  # spread at the swept row counts
                           for kind in ("swiglu_quantize", "swiglu_planes")}
PROLOGUE_PARTS = {kind: 2 for kind in PROLOGUES if kind.startswith("swiglu")}  # input row widths in units of K (else 1)
DEFAULT_MODEL = "llama3-8b"  # the shapes swept unless --models names others
ORDER_KEYS = ("block_k", "split_k", "block_n")  # change the summation order (the default split follows block_n)


def _flip_sides(kind: str, m: int) -> list[dict]:
    """The matmul with the tokens and the weights on the other MMA sides than its default at M rows
    (the W4A16 default follows the row tile, :data:`gm.ROWS_FIRST_MAX`; W4AX's is weights first)."""
    if kind == "w4a8":
        return [{"rows_first": True}, {"rows_first": True, "num_warps": 8}]
    if kind == "w4a16" and m <= gm.ROWS_FIRST_MAX:
        return [{"rows_first": False}]
    return []


def variants(kind: str, m: int, n: int, k: int) -> list[dict]:
    """The configurations tried at one (kind, M, shape); the first, ``{}``, is the default."""
    if kind == "dense":
        return _variants(kind, m, n, k)
    # the scales loaded one K iteration ahead or not: the other choice than the shape's default
    return _variants(kind, m, n, k) + [{"prefetch": not gm.default_prefetch(n, k, GROUP, "w4a16" if kind == "w4a16"
                                                                         else "w4ax")}]


def _variants(kind: str, m: int, n: int, k: int) -> list[dict]:
    if m <= 16:
        out = [{}, {"num_warps": 8}, {"num_stages": 4}, {"num_stages": 5}, {"num_warps": 8, "num_stages": 4},
               {"num_warps": 2}]
        if kind != "dense":
            bn, bk, split = gm.default_config(n, k, GROUP, "w4a16" if kind == "w4a16" else "w4ax")
            out += [{"block_n": 2 * bn}, {"block_n": 2 * bn, "num_warps": 8}, {"block_n": bn // 2},
                    {"block_k": 2 * bk}, {"block_k": bk // 2}, {"split_k": 2 * split},
                    {"block_n": 2 * bn, "split_k": 2 * split}]
            if split > 1:  # fewer programs, each with more K chunks to pipeline (qkv / o: one chunk each by default)
                out += [{"split_k": split // 2}, {"block_n": bn // 2, "split_k": split // 2}]
            if kind == "w4a16":  # half-width K chunks with the shared memory they free spent on stages
                out += [{"block_k": bk // 2, "num_stages": s} for s in (4, 5)]
        return out + _flip_sides(kind, m)
    out = [{}, {"num_warps": 8}]
    if kind != "dense":  # a taller weight tile at the default K split: x re-read by half the programs, same order
        bn, bk, split = gm.default_config(n, k, GROUP, "w4a16" if kind == "w4a16" else "w4ax")
        out += [{"block_n": 2 * bn, "split_k": split}, {"block_n": 2 * bn, "split_k": split, "num_warps": 8}]
    if m > 32:
        out += [{"block_m": 64, "num_warps": w, "num_stages": s} for w in (4, 8) for s in (2, 3)]
        # 32-row tiles: the weight tile dequantized once per 32 rows, but two CTAs per SM where a 64-row
        # W4A16 tile's 230 KB of shared memory allow one (bench.sass; Nsight Compute, session 13); for
        # W4A16 also with the weights on the MMA's M side, as at 64 rows (32-row tiles default to tokens
        # first). The other kernels try the taller grid too.
        out += [{"block_m": 32}] + ([{"block_m": 32, "rows_first": False}] if kind == "w4a16" else [])
    if m > 64:
        out += [{"block_m": 128, "num_warps": w, "num_stages": 2} for w in (4, 8)] + [
            {"block_m": 128, "num_warps": 8, "num_stages": 1}]
    out += _flip_sides(kind, m)
    if kind == "w4a16":  # half-width K chunks: half the shared memory per stage (more programs per SM),
        # but another summation order, so a default only if no slower at small M either (shape-only tiles)
        out += [{"block_k": bk // 2}, {"block_k": bk // 2, "num_stages": 4}]
        out += [{"block_k": bk // 2, "block_m": 32}] if m > 32 else []
    if kind == "w4a16" and m > gm.ROWS_FIRST_MAX:  # tokens on the MMA's M side: the dequantized weights
        out += [{"rows_first": True}, {"rows_first": True, "num_stages": 2},  # the shared-memory operand
                {"rows_first": True, "num_warps": 8}, {"rows_first": True, "block_n": 128, "num_warps": 8},
                {"rows_first": True, "block_m": 128, "num_warps": 8, "num_stages": 2},
                {"rows_first": True, "block_m": 128, "block_k": 256, "num_warps": 8, "num_stages": 2}]
    return out


MATMUL_KEYS = {"num_warps", "num_stages", "block_n", "block_k", "split_k", "block_m", "rows_first", "prefetch"}


def select(configs: list[dict], only: set[str] | None) -> list[dict]:
    """``configs``' default (``{}``) and, with ``only``, just the variants that set one of those keys."""
    return [kw for kw in configs if not kw or not only or only & set(kw)]


def _weights(kind: str, n: int, k: int) -> list:
    """Weight copies to rotate over (bench.kernels' families: bf16 for dense, packed otherwise)."""
    family = "bf16" if kind == "dense" else "packed"
    return [_weight(family, n, k, 10 + c) for c in range(_copies(_weight_bytes(family, n, k)))]


def _compare(job: Job, base: Job, kw: dict) -> str:
    if job.error or base.error:
        return "-"
    outs = [[np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(j.compiled(*j.arg_sets[0]))] for j in (job, base)]
    if all(np.array_equal(a, b) for a, b in zip(*outs, strict=True)):
        return "same bits"
    rel = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(*outs, strict=True))
    flag = "" if any(key in kw for key in ORDER_KEYS) else " (BITS DIFFER)"
    return f"rel {rel:.1e}{flag}"


def sweep_shape(model: str, shape: str, kinds: list[str], ms: list[int], tmp: Path, threads: int,
                only: set[str] | None = None) -> list[dict]:
    """The matmul kinds at one layer shape: the default and its :func:`variants` (with ``only``, those
    that set one of these keys) at each M."""
    n, k = MODELS[model][shape]
    rows = []
    for kind in kinds:
        if kind == "dense" and shape != "lm_head":
            continue
        ws = _weights(kind, n, k)
        jobs, meta = [], []
        for m in ms:
            calls = max(CALLS, len(ws))
            xs = [jax.random.normal(jax.random.key(1000 + i), (m, k), jnp.bfloat16) for i in range(calls)]
            for kw in select(variants(kind, m, n, k), only):
                fn = lambda x, w, kw=kw, kind=kind: KINDS[kind](x, w, kw)  # noqa: E731
                jobs.append(Job(fn, [(xs[i], ws[i % len(ws)]) for i in range(calls)], pallas=True))
                meta.append((m, kw))
        measure(jobs, tmp, threads)
        base = {}
        for job, (m, kw) in zip(jobs, meta):
            if not kw:
                base[m] = job
        for job, (m, kw) in zip(jobs, meta):
            row = {"shape": shape if model == DEFAULT_MODEL else f"{model} {shape}", "N": n, "K": k, "kind": kind,
                   "M": m, "config": kw,
                   "us": job.us, "error": job.error, "vs_default": _compare(job, base[m], kw) if kw else ""}
            rows.append(row)
            log(f"{row['shape']} {kind} M={m} {kw or 'default'}: "
                + (f"{job.us:.1f} us {row['vs_default']}" if job.us else f"error {job.error}"))
        del jobs, ws
    return rows


PROLOGUE_TILES = (32, 64, 128)  # max_blocks tried against the default


def prologue_variants(k: int, default_blocks: int = gpu_activations.MAX_BLOCKS) -> list[dict]:
    """Tile widths tried for a row of ``k`` by a kernel whose tiles are at most ``default_blocks`` by
    default; the first, ``{}``, is the default. Each ``max_blocks`` is the tile the kernel will use
    (the largest divisor of the row's block count up to it)."""
    blocks = k // gpu_activations.PACK_BLOCK
    default = gpu_activations.tile_blocks(blocks, default_blocks)
    tiles = sorted({gpu_activations.tile_blocks(blocks, b) for b in PROLOGUE_TILES} - {default})
    return [{}] + [{"max_blocks": t} for t in tiles]


def prologue_widths() -> list[int]:
    """The hidden and intermediate widths of every shape in :data:`bench.kernels.MODELS`."""
    return sorted({w for shapes in MODELS.values() for w in (shapes["o"][1], shapes["down"][1])})


def sweep_prologue(ms: list[int], tmp: Path, threads: int, kinds: list[str]) -> list[dict]:
    """The activation-prologue kernels ``kinds`` (of :data:`PROLOGUES`) at every model's hidden and
    intermediate widths: the default tile against narrower ones, which must give the same bits."""
    rows = []
    for k in prologue_widths():
        scale = jax.random.uniform(jax.random.key(7), (k,), jnp.bfloat16, 0.5, 1.5)
        jobs, meta = [], []
        for m in ms:
            inputs = {parts: [jax.random.normal(jax.random.key(2000 + i), (m, parts * k), jnp.bfloat16)
                              for i in range(CALLS)] for parts in (1, 2)}
            for kind in kinds:
                fn = PROLOGUES[kind]
                xs = inputs[PROLOGUE_PARTS.get(kind, 1)]
                for kw in prologue_variants(k, PROLOGUE_DEFAULT_BLOCKS.get(kind, gpu_activations.MAX_BLOCKS)):
                    jobs.append(Job(lambda x, s, fn=fn, kw=kw: fn(x, s, kw), [(x, scale) for x in xs], pallas=True))
                    meta.append((kind, m, kw))
        measure(jobs, tmp, threads)
        base = {(kind, m): job for job, (kind, m, kw) in zip(jobs, meta) if not kw}
        for job, (kind, m, kw) in zip(jobs, meta):
            row = {"shape": f"prologue K={k}", "N": 0, "K": k, "kind": kind, "M": m, "config": kw, "us": job.us,
                   "error": job.error, "vs_default": _compare(job, base[kind, m], kw) if kw else ""}
            rows.append(row)
            log(f"prologue K={k} {kind} M={m} {kw or 'default'}: "
                + (f"{job.us:.1f} us {row['vs_default']}" if job.us else f"error {job.error}"))
    return rows


def attention_variants(context: int, bits: int) -> list[dict]:
    """The attention configurations tried at one context over a cache of ``bits`` (16: bf16; 8 / 4:
    the draft's shadow, whose pipeline depth is swept too); the first, ``{}``, is the default."""
    tiles = [{"block_s": bs, "splits": sp} for bs in (64, 128, 256) for sp in (1, 2, 4, 8, 16, 32) if context // bs >= sp]
    default_warps = gpu_attention.SHADOW_WARPS if bits < 16 else gpu_attention.FLOAT_WARPS
    warps = [{"num_warps": w} for w in (2, 4, 8) if w != default_warps]
    return [{}] + tiles + warps + ([{"num_stages": n} for n in (2, 4)] if bits < 16 else [])


def sweep_attention(batches: list[int], contexts: list[int], kv_bits: list[int], tmp: Path, threads: int,
                    bw: float, queries: tuple[int, ...] = (1, 4)) -> list[dict]:
    """Decode attention (the heads of :data:`bench.kernels.ATTN`, ``--attn-heads``) over the caches of
    ``kv_bits`` (16: bf16, 8 / 4: the shadow): the default KV block and cache splits against others,
    per (batch, context, T of ``queries``);
    ``vs_default`` is the max relative output difference (a split count other than the default merges
    the partial softmaxes in another grouping)."""
    rows = []
    for b in batches:
        for ctx in contexts:
            jobs, meta = [], []
            for (t, bits), sets in _attn_inputs(b, ctx, queries, kv_bits).items():
                for kw in attention_variants(ctx, bits):
                    jobs.append(Job(lambda *args, kw=kw: attention_call(*args, **kw), sets, pallas=True))
                    meta.append((t, bits, kw))
            measure(jobs, tmp, threads)
            base = {(t, bits): job for job, (t, bits, kw) in zip(jobs, meta) if not kw}
            for job, (t, bits, kw) in zip(jobs, meta):
                diff = "" if not kw else _max_rel_diff(job, base[t, bits])
                floor = _attn_bytes(b, ctx, t, bits)[0] / bw * 1e6
                cache = "" if bits == 16 else f" INT{bits} shadow"
                heads = "H={},KV={},d={} ".format(*ATTN["heads"])
                rows.append({"shape": f"attention {heads}B={b} ctx={ctx}{cache}", "kind": "attention", "M": t, "config": kw,
                             "us": job.us, "error": job.error, "floor_us": floor,
                             "vs_default": "" if not kw else ("-" if diff is None else f"rel {diff:.1e}")})
                log(f"attention {heads}B={b} ctx={ctx}{cache} T={t} {kw or 'default'}: "
                    + (f"{job.us:.1f} us ({job.us / floor:.2f}x floor)" if job.us else f"error {job.error}"))
    return rows


def markdown(run: dict) -> str:
    lines = [f"# Matmul tile sweep ({run['device']})", "", f"`{run['command']}`", "",
             "Matmuls: Llama-3-8B shapes (others named), random symmetric g128 weights (bf16 for dense); prologues: every "
             "model's hidden and intermediate widths; CUPTI kernel µs per call "
             "(weights rotated out of L2). `vs default`: the output compared with the default tiles' "
             "on the same input. Attention rows: M is the number of new queries T; floor = (K + V + q + "
             "output bytes) / the copy bandwidth measured in the same run.", "",
             "| shape | kind | M | config | µs | vs default µs | vs default output |", "|---|---|---|---|---|---|---|"]
    base = {(r["shape"], r["kind"], r["M"]): r["us"] for r in run["rows"] if not r["config"]}
    for r in run["rows"]:
        b = base.get((r["shape"], r["kind"], r["M"]))
        cfg = ", ".join(f"{key}={v}" for key, v in r["config"].items()) or "**default**"
        us = f"{r['us']:.1f}" if r["us"] else f"n/a ({(r['error'] or '')[:60]})"
        ratio = f"{b / r['us']:.2f}×" if r["us"] and b else ""
        if r["us"] and r.get("floor_us"):
            us += f" ({r['us'] / r['floor_us']:.2f}× floor)"
        lines.append(f"| {r['shape']} | {r['kind']} | {r['M']} | {cfg} | {us} | {ratio} | {r['vs_default']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--models", default=DEFAULT_MODEL, help=f"whose layer shapes, of {', '.join(MODELS)}")
    ap.add_argument("--kinds", default="w4a16,w4a8,dense")
    ap.add_argument("--ms", type=int_list(), default="16,32,64,128,256")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    ap.add_argument("--budget-s", type=positive_seconds, default=400.0, help="start no shape after this")
    ap.add_argument("--attn", default=None, metavar="BATCHES:CONTEXTS",
                    help="also sweep decode attention, e.g. 8,16:1024,2048 (KV block x cache splits)")
    ap.add_argument("--attn-kv", default="16", metavar="BITS",
                    help="with --attn: the caches, of 16 (bf16) and the shadow's 8 and 4, e.g. 16,8,4")
    ap.add_argument("--attn-queries", default="1,4", metavar="TS",
                    help="with --attn: the new queries per sequence (T) to time, e.g. 1,2")
    ap.add_argument("--attn-heads", default=",".join(map(str, ATTN["heads"])), metavar="H,KV,D",
                    help="with --attn: query heads, KV heads and head size (default Llama-3-8B's; Llama-2-7B: 32,32,128)")
    ap.add_argument("--prologue", type=int_list(), default=None, metavar="MS",
                    help="also sweep the activation-prologue kernels' tile width at these row counts, e.g. 1,16,64")
    ap.add_argument("--prologue-kinds", default=",".join(PROLOGUES), metavar="KINDS",
                    help=f"with --prologue: which kernels, of {', '.join(PROLOGUES)}")
    ap.add_argument("--only", default=None, metavar="KEYS",
                    help="matmuls: only the variants that set one of these keys, e.g. rows_first")
    ap.add_argument("--threads", type=positive_int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    models = args.models.split(",")
    only = set(args.only.split(",")) if args.only else None
    if only and only - MATMUL_KEYS:
        raise SystemExit(f"--only: unknown keys {sorted(only - MATMUL_KEYS)}; known: {sorted(MATMUL_KEYS)}")
    prologue_kinds = args.prologue_kinds.split(",")
    unknown = ([x for x in kinds if x not in KINDS] + [x for x in prologue_kinds if x not in PROLOGUES]
               + [m for m in models if m not in MODELS] + [s for s in args.shapes.split(",") if s and s not in MODELS[DEFAULT_MODEL]])
    if unknown:
        raise SystemExit(f"unknown kinds/models/shapes: {unknown}")
    kv_bits = [int(v) if v.isdigit() else -1 for v in args.attn_kv.split(",")]
    if set(kv_bits) - {16, 8, 4}:
        raise SystemExit(f"--attn-kv: caches of 16 (bf16), 8 or 4 bits, got {args.attn_kv!r}")
    heads = tuple(int(v) if v.isdigit() else 0 for v in args.attn_heads.split(","))
    if len(heads) != 3 or min(heads) < 1 or heads[0] % heads[1]:
        raise SystemExit(f"--attn-heads: H,KV,D, positive integers with KV dividing H, got {args.attn_heads!r}")
    if args.attn:
        try:
            attn_batches, attn_contexts = (int_list()(part) for part in args.attn.split(":"))
        except (argparse.ArgumentTypeError, ValueError) as e:  # a bad number, or not two parts
            raise SystemExit(f"--attn: BATCHES:CONTEXTS, comma-separated integers >= 1, got {args.attn!r}") from e
    ATTN["heads"] = heads  # read by bench.kernels' attention inputs and byte counts
    queries = tuple(int(v) if v.isdigit() else 0 for v in args.attn_queries.split(","))
    if min(queries) < 1:
        raise SystemExit(f"--attn-queries: new queries per sequence >= 1, got {args.attn_queries!r}")
    if jax.default_backend() != "gpu":
        raise SystemExit("bench.tune times GPU kernels: run it on the GPU machine")
    ms = args.ms
    deadline = time.time() + args.budget_s
    run = {"command": command_line("bench.tune", argv),
           "device": jax.devices()[0].device_kind, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.attn:
            batches, contexts = attn_batches, attn_contexts
            copy_bandwidth(run, Path(tmp), args.threads)
            run["rows"] += sweep_attention(batches, contexts, kv_bits, Path(tmp), args.threads, run["copy_bw"],
                                           queries)
        if args.prologue:
            run["rows"] += sweep_prologue(args.prologue, Path(tmp), args.threads,
                                          prologue_kinds)
        for model in models:
            for shape in [s for s in args.shapes.split(",") if s]:
                if time.time() > deadline:
                    log(f"time budget: {model} {shape} not run")
                    continue
                run["rows"] += sweep_shape(model, shape, kinds, ms, Path(tmp), args.threads, only)
                write(run, args.out)
    write(run, args.out)
    print(markdown(run))


def write(run: dict, out: Path) -> None:
    """``tune.json`` and ``tune.md`` under ``out``."""
    (out / "tune.json").write_text(json.dumps(run, indent=1))
    (out / "tune.md").write_text(markdown(run))


if __name__ == "__main__":
    main()
