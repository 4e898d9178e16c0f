"""Where a decode step's GPU time goes: per-kernel time of decode-time forwards, from a profiler trace.

    PYTHONPATH=. python3 -m bench.profile [--model llama3-8b] [--batch 8] [--context 512] \
        [--runs w4a16:1,w4a8:1,w4a16:4,w4a8/kv8:1,w4a16/kv8:4] [--reps 8] [--out DIR]

Each ``mode:tokens`` run traces (``jax.profiler``, Perfetto JSON) one call of
:func:`bench.decode.forward_loop`: ``--reps`` forwards of ``tokens`` new tokens per sequence in one
jitted loop, on a random-weight model shape with a decode state of ``--context`` tokens (``mode/kvBITS``:
the state carries an INT8 / INT4 KV shadow, which a W4A8 / W4A4 draft forward reads and a W4A16 verify
forward re-quantizes, as in QSPEC with ``draft_kv``; ``/winSIZE[+SINKS]``: a draft forward attends over
the first SINKS and the last SIZE positions only, as with ``draft_window``). GPU events
are summed per kernel name and per category (INT4 matmuls, attention, RMSNorm, lm_head, copies, other
XLA ops) and divided by ``--reps``: microseconds per forward. GPU only (the CPU trace has no per-op
events). Writes ``profile.md`` / ``profile.json`` under ``--out`` (default ``$OUT``, else bench/results).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.args import command_line, git_commit, utc_now
from bench.decode import DRAFT_GRAMMAR, forward_carry, forward_loop, fresh_state, parse_draft, random_params
from bench.shapes import MODELS
from pallas_kernels.precision import PRECISIONS
from qspec_jax.decode import Runtime
from qspec_jax.kernels import Execution

# (category, kernel-name prefix): Pallas kernels are named after their Python functions
CATEGORIES = (("W4A16 matmul", "_w4a16_kernel"), ("W4A8/W4A4 matmul", "_w4ax_kernel"),
              ("lm_head (dense)", "_dense_kernel"), ("attention", "_attention_kernel"),
              ("activation prologue", "_prologue_kernel"), ("activation prologue", "_swiglu_"),
              ("attention merge prologue", "_merge_"),
              ("RMSNorm", "_rms_norm_kernel"), ("copies", "memcpy"), ("copies", "Memcpy"))


def category(name: str) -> str:
    return next((c for c, prefix in CATEGORIES if name.startswith(prefix)), "other XLA ops")


LAUNCH_KEYS = ("regist", "grid", "block", "shared", "occupancy")  # the launch facts kept per kernel


def gpu_kernel_times(trace: dict) -> tuple[dict[str, float], dict[str, int], dict[str, dict]]:
    """Microseconds and event counts per kernel name, over the events of GPU device processes, and each
    kernel's launch facts (registers per thread, grid, block, shared memory, occupancy) where the
    trace's event arguments carry them."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "/device:GPU" in e.get("args", {}).get("name", "")}
    us: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    launch: dict[str, dict] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            us[e["name"]] += float(e.get("dur", 0.0))
            count[e["name"]] += 1
            launch.setdefault(e["name"], {k: v for k, v in e.get("args", {}).items()
                                          if any(word in k.lower() for word in LAUNCH_KEYS)})
    return dict(us), dict(count), launch


def summarize(us: dict[str, float], count: dict[str, int], launch: dict[str, dict], reps: int) -> dict:
    """Per forward: total, per category, and per kernel name (largest first, with its launch facts)."""
    cats: dict[str, float] = collections.Counter()
    for name, t in us.items():
        cats[category(name)] += t / reps
    kernels = sorted(((n, t / reps, count[n] / reps) for n, t in us.items()), key=lambda r: -r[1])
    return {"total_us": sum(us.values()) / reps, "categories": dict(cats),
            "kernels": [{"name": n, "us": t, "calls": c, "launch": launch.get(n, {})} for n, t, c in kernels]}


def profile_run(params, rt: Runtime, state, mode: str, tokens: int, reps: int, draft: bool = False) -> dict:
    fn, carry = forward_loop(rt, mode, reps, draft), forward_carry(state, tokens)
    carry = jax.block_until_ready(fn(params, carry))  # compile and warm up
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn(params, carry))
        files = sorted(Path(d).rglob("*.json.gz"))
        if not files:
            raise SystemExit("the profiler wrote no Perfetto trace")
        trace = json.load(gzip.open(files[0]))
    us, count, launch = gpu_kernel_times(trace)
    if not us:
        raise SystemExit("no GPU events in the trace: bench.profile needs a GPU")
    return summarize(us, count, launch, reps)


def markdown(run: dict) -> str:
    lines = [f"# Decode forward, kernel by kernel ({run['device']})", "", f"`{run['command']}`", "",
             f"{run['model']}, random weights, batch {run['batch']}, decode state of {run['context']} "
             f"tokens, bf16; microseconds per forward (GPU events of a traced loop of {run['reps']}).", ""]
    for key, r in run["runs"].items():
        lines += [f"## {key}: {r['total_us']:.0f} µs per forward", "", "| category | µs | share |", "|---|---|---|"]
        for c, t in sorted(r["categories"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {c} | {t:.1f} | {100 * t / r['total_us']:.0f}% |")
        lines += ["", "| kernel | µs | calls | launch |", "|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['us']:.1f} | {k['calls']:g} | "
                  f"{', '.join(f'{key} {v}' for key, v in k.get('launch', {}).items())} |" for k in r["kernels"][:20]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--runs", default="w4a16:1,w4a8:1,w4a16:4", help="mode:tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    args = ap.parse_args(argv)
    runs = []
    for item in args.runs.split(","):
        spec, _, tokens = item.partition(":")
        try:
            draft = parse_draft(spec, tuple(p.name for p in PRECISIONS))
        except ValueError as e:
            ap.error(f"--runs: {e}")
        if not tokens.isdigit() or int(tokens) < 1:
            ap.error(f"--runs: expected {DRAFT_GRAMMAR}:tokens, got {item!r}")
        runs.append((spec, draft, int(tokens)))
    cfg = MODELS[args.model]
    params = random_params(cfg, jax.random.key(1))
    rt = Runtime(cfg, dtype=jnp.bfloat16, execution=Execution.decode())
    out = {"command": command_line("bench.profile", argv),
           "device": jax.devices()[0].device_kind, "date": utc_now(), "commit": git_commit(),
           "model": args.model, "batch": args.batch,
           "context": args.context, "reps": args.reps, "runs": {}}
    for spec, draft, tokens in runs:  # a fresh state each: the loop donates its cache
        state = fresh_state(cfg, args.batch, args.context, 64, tokens, 0, draft.kv)
        out["runs"][f"{spec}, {tokens} token(s) per sequence"] = profile_run(
            params, draft.runtime(rt), state, draft.mode, tokens, args.reps,
            draft=(draft.kv is not None or draft.window is not None) and draft.mode != "w4a16")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(out, indent=1))
    text = markdown(out)
    (args.out / "profile.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
