"""Prefill time of long prompts (W4A16, random INT4 weights of a Llama shape), against the prefill that
attends over the whole cache and computes every position's logits, and against the bf16 matmul rate.

    PYTHONPATH=. python3 -m bench.prefill [--models llama3-8b] [--batches 16] [--prompt 3584] [--new 512]
        [--reps 3] [--kernels auto] [--out DIR]

Per (model, batch): a fresh decode state of ``--prompt`` random tokens per sequence and room for ``--new``
more, run through ``qspec_jax.core.prefill`` (the library's: each query attends causally over the prompt's
own keys, cuDNN flash attention on a GPU; logits only at each prompt's last position) and through the
previous prefill (the same forward over the whole cache, every position's logits, then the last ones picked;
"out of memory" where it does not fit). Seconds: the best of ``--reps`` calls after a warm-up, each on a
fresh state. Matmul rate: the prefill's matmul FLOPs (2 x weights x tokens, the lm_head only for the rows
each computes) over its time, against XLA's bf16 dot on square operands (8192 on a GPU) measured in the same
run.

Writes ``prefill.json`` and ``prefill.md`` under ``--out`` (default ``$OUT``, else bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.args import command_line, git_commit, int_list, positive_int, utc_now
from bench.decode import best_seconds, matmul_flops_per_token, matmul_rates, random_params
from bench.shapes import MODELS
from pallas_kernels.precision import W4A16
from qspec_jax.core import Decoder, init_state, prefill
from qspec_jax.decode import DecodeState, Runtime
from qspec_jax.kernels import KERNELS, Execution, resolve_kernels


def previous_prefill(params, state: DecodeState, rt: Runtime) -> tuple[jax.Array, DecodeState]:
    """The baseline: the prompts' forward attending over the whole cache, every position's logits; the
    last prompt position's picked (what a prefill needs)."""
    b, p = state.tokens.shape[0], state.prompt_width
    logits, cache = rt.run(params, state.tokens[:, :p], jnp.broadcast_to(jnp.arange(p), (b, p)), state.cache,
                           W4A16, execution=dataclasses.replace(rt.execution, row_tile=None))
    return logits[jnp.arange(b), state.prompt_lengths - 1], dataclasses.replace(state, cache=cache)


def linear_flops(cfg, tokens: int, head_rows: int) -> float:
    """The decoder linears' FLOPs for ``tokens`` tokens and the lm_head's for ``head_rows`` of them."""
    return float(tokens * matmul_flops_per_token(cfg, 0) + head_rows * (matmul_flops_per_token(cfg)
                                                                        - matmul_flops_per_token(cfg, 0)))


def measure(name: str, batch: int, args, rate: float) -> dict:
    cfg = MODELS[name]
    params = random_params(cfg, jax.random.key(1))
    rt = Runtime(cfg, dtype=jnp.bfloat16, execution=Execution.decode(args.kernels))
    dec = Decoder(rt, W4A16)
    tokens = jax.random.randint(jax.random.key(2), (batch, args.prompt), 0, cfg.vocab_size, jnp.int32)
    make = lambda: init_state(dec, tokens, jnp.full((batch,), args.prompt, jnp.int32),  # noqa: E731
                              jax.random.key(0), max_new_tokens=args.new, buffer_len=args.prompt + args.new)
    # whole states out: the cache writes are part of the work
    lib = jax.jit(lambda p, s: prefill(p, dec, s), donate_argnums=1)
    old = jax.jit(lambda p, s: previous_prefill(p, s, rt), donate_argnums=1)
    t_lib = best_seconds(lambda s: lib(params, s), args.reps, make)
    n = batch * args.prompt
    res = {"model": name, "batch": batch, "prompt": args.prompt, "buffer": args.prompt + args.new, "seconds": t_lib,
           "matmul_tflops": linear_flops(cfg, n, batch) / t_lib / 1e12,
           "of_bf16_rate": linear_flops(cfg, n, batch) / t_lib / rate}
    try:  # its [T, S] scores and every position's logits may not fit where the library's prefill does
        t_old = best_seconds(lambda s: old(params, s), args.reps, make)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return res | {"previous": "out of memory"}
    return res | {"previous_seconds": t_old, "speedup": t_old / t_lib,
                  "previous_matmul_tflops": linear_flops(cfg, n, n) / t_old / 1e12}


def markdown(run: dict) -> str:
    lines = [f"# Prefill ({run['device']})", "",
             f"`{run['command']}`", "",
             f"{run['date']}, commit {run['commit']}, kernels {run['kernels']}. bf16 matmul rate (XLA dot, square operands) "
             f"{run['bf16_rate'] / 1e12:.0f} TFLOP/s in this run. Random INT4 weights (symmetric, group 128), bf16 "
             "activations; prefill = the library's (causal over the prompt's own keys, logits at each last "
             "position); previous = over the whole cache with every position's logits. Matmul TFLOP/s: the "
             "linears' FLOPs each computes over its time.", "",
             "| model | batch | prompt | prefill s | previous s | speed-up | matmul TFLOP/s | of bf16 rate "
             "| previous TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in run["results"]:
        prev, prev_rate = ((f"{r['previous_seconds']:.3f} | {r['speedup']:.2f}×", f"{r['previous_matmul_tflops']:.0f}")
                           if "previous_seconds" in r else (f"{r['previous']} | n/a", "n/a"))
        lines.append(f"| {r['model']} | {r['batch']} | {r['prompt']} | {r['seconds']:.3f} | {prev} "
                     f"| {r['matmul_tflops']:.0f} | {100 * r['of_bf16_rate']:.0f}% | {prev_rate} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b")
    ap.add_argument("--batches", type=int_list(), default="16")
    ap.add_argument("--prompt", type=positive_int, default=3584)
    ap.add_argument("--new", type=positive_int, default=512, help="room left in the cache after the prompt")
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--kernels", default="auto", choices=KERNELS)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    args = ap.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    if unknown := [n for n in names if n not in MODELS]:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    for n in names:
        if args.prompt + args.new > MODELS[n].max_position_embeddings:
            raise SystemExit(f"{n}: {args.prompt} + {args.new} tokens exceed its {MODELS[n].max_position_embeddings} "
                             "positions")
    rate = matmul_rates()["bf16"]
    run = {"command": command_line("bench.prefill", argv), "device": jax.devices()[0].device_kind, "date": utc_now(),
           "commit": git_commit(), "jax": jax.__version__, "kernels": resolve_kernels(args.kernels), "bf16_rate": rate,
           "results": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        for batch in args.batches:
            r = measure(name, batch, args, rate)
            run["results"].append(r)
            prev = (f"previous {r['previous_seconds']:.3f} s, {r['speedup']:.2f}x" if "previous_seconds" in r
                    else f"previous: {r['previous']}")
            print(f"{name} B={batch} prompt={args.prompt}: {r['seconds']:.3f} s ({prev}), {r['matmul_tflops']:.0f} "
                  f"TFLOP/s = {100 * r['of_bf16_rate']:.0f}% of bf16", flush=True)
            (args.out / "prefill.json").write_text(json.dumps(run, indent=1))
            (args.out / "prefill.md").write_text(markdown(run))


if __name__ == "__main__":
    sys.exit(main())
