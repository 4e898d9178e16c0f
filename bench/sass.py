"""What a Pallas GPU kernel executes per loop iteration, counted without a GPU: SASS instructions.

    python -m bench.sass attention --kv-bits 8 [--batch 16 --heads 32 --kv-heads 32 --head-dim 128
        --slots 4096 --queries 1] [--out FILE]
    python -m bench.sass w4a16 --m 16 --n 28672 --k 4096 [--group 128 --block-m 32 --num-warps 4 --num-stages 3
        --rows-first --prefetch] [--out FILE]
    python -m bench.sass w4ax --m 16 --n 28672 --k 4096 [... as w4a16, --words]

The kernel is lowered for CUDA on this machine (jax's Triton lowering, with an H200 as the assumed
target), each Pallas kernel's Triton module is taken as text, compiled for sm_90 by a local
``triton`` (the version on the GPU machine, 3.6, pinned in requirements.lock and the ``bench`` extra,
so CI runs the compile tests) and disassembled with the ``cuobjdump`` that comes with it. For each loop of the SASS
(a backward branch) the table gives its instructions per iteration and thread, by opcode. The
module first goes through Triton's TTIR passes, as in XLA's pipeline (before session 12 it did not:
the counts then missed the combine pass's folding of ``acc + dot`` into the dot). XLA
compiles the same module with its own bundled Triton and ptxas, so the counts are indicative, not
the instructions that run; they tell which parts of a loop body cost issue slots, and how a kernel
change moves them, before any device time is spent (bench/results/kv_shadow.md). Each kernel's
registers per thread and shared memory per CTA give its CTAs per SM (:func:`occupancy`); for the
W4A16 kernel they match Nsight Compute's on the H200 (session 13: 92 / 239 registers, 66,560 /
230,400 bytes at M = 16 / 64 with the 512-wide K chunks of then, against 95 / 240 and the same bytes
counted here).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import gpu_info, pallas_call_registration
from bench.args import command_line

# sm_90 (H100 / H200) per-SM limits, CUDA occupancy rules
SM_SHARED, SHARED_UNIT = 233472, 128  # shared memory per SM (228 KiB, at most 227 KiB per CTA), allocated in 128 B
CTA_RESERVED_SHARED = 1024  # the driver's shared memory per CTA
# registers: 4 sub-partitions of 16384, each holding whole warps, allocated per warp in units of 256
SM_PARTITIONS, PARTITION_REGISTERS, REGISTER_UNIT = 4, 16384, 256
SM_WARPS, SM_CTAS = 64, 32

_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]*)?\s*(.*?);")


@contextlib.contextmanager
def _capture_modules(modules: list[tuple[str, str]]):
    """While active, every Pallas Triton lowering appends ``(kernel name, module text)`` to
    ``modules``, and the lowering assumes an H200 (there is no GPU to ask)."""
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module
    get_info = gpu_info.get_gpu_info

    def recording(*args, **kwargs):
        result = lower(*args, **kwargs)
        text = result.module.operation.get_asm()
        name = re.search(r"tt\.func public @([\w$.]+)", text).group(1)
        modules.append((name, text))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = recording
    gpu_info.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    try:
        yield
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower
        gpu_info.get_gpu_info = get_info


def triton_modules(fn, *args) -> list[dict]:
    """``[{name, module (Triton IR text), num_warps, num_stages}]`` of the Pallas kernels ``jit(fn)``
    launches on ``args`` (arrays or ``ShapeDtypeStruct``), from a CUDA lowering on this machine."""
    modules: list[tuple[str, str]] = []
    with _capture_modules(modules):
        hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    params = collections.defaultdict(list)  # per kernel name, its launches' (warps, stages) in order
    for m in re.finditer(r'name = "([\w$.]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', hlo):
        params[m.group(1)].append((int(m.group(3)), int(m.group(2))))
    out = []
    for name, text in modules:
        warps, stages = params[name].pop(0)
        out.append(dict(name=name, module=text, num_warps=warps, num_stages=stages))
    return out


def occupancy(registers: int, shared: int, warps: int) -> tuple[int, str]:
    """``(CTAs per SM, the limiting resource)`` on sm_90 for a kernel of ``registers`` per thread,
    ``shared`` bytes of shared memory per CTA and ``warps`` per CTA."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    per_cta = -(-shared // SHARED_UNIT) * SHARED_UNIT + CTA_RESERVED_SHARED
    limits = {"shared memory": SM_SHARED // per_cta,
              "registers": PARTITION_REGISTERS // per_warp * SM_PARTITIONS // warps,
              "warps": SM_WARPS // warps, "CTAs": SM_CTAS}
    name = min(limits, key=limits.get)
    return limits[name], name


def compile_sass(module: str, num_warps: int, num_stages: int) -> dict:
    """``{ttgir, ptx, sass, registers, shared}`` of a Triton module (text) compiled for sm_90 by the
    local triton: the code, registers per thread and shared memory bytes per CTA."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        raise SystemExit("bench.sass needs a local triton to compile with: pip install triton==3.6.0") from None
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    target, options = GPUTarget("cuda", 90, 32), dict(num_warps=num_warps, num_stages=num_stages)
    backend = make_backend(target)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ttir"
        src.write_text(module)
        # triton.compile starts an IR source at the stage after it: the TTIR passes (canonicalize,
        # combine: dot(a, b, 0) + c -> dot(a, b, c), ...) run here first, as XLA's pipeline runs them
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        mod = ir.parse_mlir_module(str(src), context)
        mod.context = context
        backend.make_ttir(mod, {}, backend.parse_options(options), target.arch)
        src.write_text(str(mod))
        k = triton.compile(str(src), target=target, options=options)
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(k.asm["cubin"])
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        sass, usage = (subprocess.run([str(cuobjdump), flag, str(cubin)], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-sass", "--dump-resource-usage"))
    registers = int(re.search(r"\bREG:(\d+)", usage).group(1))
    return {"ttgir": k.asm["ttgir"], "ptx": k.asm["ptx"], "sass": sass, "registers": registers,
            "shared": k.metadata.shared}


def loops(sass: str) -> list[dict]:
    """Each loop of a SASS listing, innermost (shortest) first: ``{start, end, instructions, opcodes}``,
    a loop being the instructions from a backward branch's target to the branch itself."""
    code = [(int(m.group(1), 16), m.group(2), m.group(4)) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    found = []
    for addr, op, operands in code:
        target = re.match(r"(0x[0-9a-f]+)", operands.strip()) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= addr]
            found.append({"start": int(target.group(1), 16), "end": addr, "instructions": len(body),
                          "opcodes": dict(collections.Counter(body).most_common())})
    return sorted(found, key=lambda lp: lp["instructions"])


def markdown(title: str, command: str, kernels: list[dict]) -> str:
    lines = [f"# SASS per loop iteration: {title}", "", f"`{command}`", "",
             "Compiled for sm_90 by a local triton (indicative: XLA compiles with its own); per thread.", ""]
    for k in kernels:
        ctas, limit = occupancy(k["registers"], k["shared"], k["num_warps"])
        lines += [f"## `{k['name']}` ({k['num_warps']} warps, {k['num_stages']} stages)", "",
                  f"{k['registers']} registers per thread, {k['shared']:,} bytes of shared memory per CTA: "
                  f"{ctas} CTA{'' if ctas == 1 else 's'} per SM ({limit} bound), {ctas * k['num_warps']} warps", ""]
        if not k["loops"]:
            lines += ["No loop.", ""]
        for lp in k["loops"]:
            ops = ", ".join(f"{op} {n}" for op, n in lp["opcodes"].items())
            lines += [f"- loop at {lp['start']:#x}-{lp['end']:#x}: **{lp['instructions']} instructions** ({ops})"]
        lines.append("")
    return "\n".join(lines)


def _attention(args):
    from pallas_kernels import gpu_attention

    b, h, kvh, d, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.slots
    q = jax.ShapeDtypeStruct((b, args.queries, h, d), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((b, args.queries), jnp.int32)
    if args.kv_bits == 16:
        kv = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.bfloat16)
        return (lambda q, k, v, p: gpu_attention.decode_attention(q, k, v, p)), (q, kv, kv, pos)
    words = jax.ShapeDtypeStruct((b, s, kvh, d * args.kv_bits // 16), jnp.int16)
    scales = jax.ShapeDtypeStruct((b, kvh, s), jnp.float32)
    return ((lambda q, k, v, x, y, p: gpu_attention.decode_attention(q, k, v, p, scales=(x, y))),
            (q, words, words, scales, scales, pos))


def _matmul(args):
    """The W4A16 matmul on bf16 rows, or the W4AX kernel on int8 rows already in its plane layout."""
    from bench.kernels import make_weight
    from pallas_kernels import gpu_matmul

    w = jax.eval_shape(lambda: make_weight(jax.random.key(0), args.n, args.k, args.group, True))
    tiles = {"block_m": args.block_m, "num_warps": args.num_warps, "num_stages": args.num_stages,
             "prefetch": args.prefetch}  # None: the kernel's defaults for this M and shape
    if args.kernel == "w4a16":
        x = jax.ShapeDtypeStruct((args.m, args.k), jnp.bfloat16)
        return (lambda x, w: gpu_matmul.w4a16_matmul(x, w, rows_first=args.rows_first, **tiles)), (x, w)
    qx = jax.ShapeDtypeStruct((2, args.m, args.k // 2), jnp.int8)
    sa = jax.ShapeDtypeStruct((args.m, 1), jnp.float32)
    return ((lambda q, s, w: gpu_matmul.w4ax_quantized(q, s, w, rows_first=bool(args.rows_first), words=args.words,
                                                       **tiles)),
            (qx, sa, w))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=None, help="also write the table here")
    sub = ap.add_subparsers(dest="kernel", required=True)
    att = sub.add_parser("attention", parents=[common], help="decode attention over the bf16 cache or the draft's shadow")
    att.add_argument("--kv-bits", type=int, choices=(16, 8, 4), default=16)
    for name, default in (("batch", 16), ("heads", 32), ("kv-heads", 32), ("head-dim", 128), ("slots", 4096),
                          ("queries", 1)):
        att.add_argument(f"--{name}", type=int, default=default)
    for kind, help_ in (("w4a16", "the W4A16 matmul"), ("w4ax", "the W4A8 / W4A4 matmul (int8 rows)")):
        mm = sub.add_parser(kind, parents=[common], help=help_)
        for name, default in (("m", 16), ("n", 28672), ("k", 4096), ("group", 128), ("block-m", None),
                              ("num-warps", None), ("num-stages", None)):
            mm.add_argument(f"--{name}", type=int, default=default)
        mm.add_argument("--rows-first", action=argparse.BooleanOptionalAction, default=None,
                        help="the tokens on the MMA's M side (default: the kernel's choice)")
        mm.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                        help="scales loaded one K iteration ahead (default: the kernel's choice)")
        if kind == "w4ax":
            mm.add_argument("--words", action=argparse.BooleanOptionalAction, default=None,
                            help="the packed bytes read as uint16 words (default: only where a uint8 stack "
                                 "would wrap int32 offsets)")
    args = ap.parse_args(argv)
    fn, fn_args = (_attention if args.kernel == "attention" else _matmul)(args)
    kernels = triton_modules(fn, *fn_args)
    if not kernels:
        raise SystemExit("no Pallas kernel in this call (a shape the kernels do not take falls back to XLA)")
    for k in kernels:
        built = compile_sass(k["module"], k["num_warps"], k["num_stages"])
        k.update(loops=loops(built["sass"]), registers=built["registers"], shared=built["shared"])
    text = markdown(args.kernel, command_line("bench.sass", argv),
                    kernels)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
