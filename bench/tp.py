"""Tensor-parallel decode throughput: W4A16 AR and QSPEC (acceptance replayed from a trace) at degree
``--tp`` N against one device, and the all-reduce time per decode step against its floor.

    PYTHONPATH=. python3 -m bench.tp --tp 2 --trace bench/results/acceptance_contexts.json \
        [--models llama2-13b,llama2-70b] [--batches 1,8,16] [--contexts 512,4096] [--new 512]
        [--drafts w4a8] [--gammas 3] [--reps 1] [--kernels auto] [--out DIR]

Per (model, context, batch), random INT4 weights (symmetric, group 128) and a state of ``context`` random
committed tokens per sequence: each method's jitted decode loop generates ``--new`` tokens per sequence
at N shards (``qspec_jax.sharding``: heads, MLP features and the KV cache split, o's and down's results
summed with one ``psum`` each) and on one device where the configuration fits there; tokens/s, speed-up
over one device and scaling efficiency (speed-up / N). All-reduce per step: 2 x layers ``psum`` of the
``[batch, hidden]`` float32 partial sums, timed alone in one loop; its floor: the bytes a ring all-reduce
moves per device, 2 (N - 1) / N x the message, over the bus bandwidth of a large all-reduce measured in
the same run.

Writes ``tp.json`` and ``tp.md`` under ``--out`` (default ``$OUT``, else bench/results) after each
configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from bench.args import at_least, command_line, git_commit, int_list, positive_int, read_json, utc_now
from bench.decode import (best_seconds, draft_rounds, fresh_state, matmul_flops_per_token, memory_limit, memory_need,
                          parse_draft, random_params, time_loop, trace_rows)
from bench.hooks import replay_loop
from bench.shapes import MODELS
from pallas_kernels.precision import W4A16, parse_precision
from qspec_jax import sharding
from qspec_jax.core import Decoder, decode
from qspec_jax.decode import DecodeState, Runtime
from qspec_jax.kernels import KERNELS, Execution, resolve_kernels

LARGE_ALLREDUCE = {"gpu": 1 << 26, "cpu": 1 << 18}  # float32 elements of the bus-bandwidth probe


def placed(state: DecodeState, tp: int) -> DecodeState:
    """``state`` laid out as the sharded loops read it (KV heads split), so no timed call reshards it."""
    if tp == 1:
        return state
    m = sharding.mesh(tp)
    shardings = jax.tree.map(lambda s: NamedSharding(m, s), sharding.state_specs(state),
                             is_leaf=lambda s: isinstance(s, P))
    return jax.device_put(state, shardings)


def loops(cfg, tp: int, args, table: dict) -> dict:
    """``{method: (jitted f(params, state) -> state, the KV shadow's bits or None)}`` at degree ``tp``:
    W4A16 AR and QSPEC for each draft and gamma, its accept decisions replayed from the trace ``table``."""
    rt = Runtime(cfg, dtype=jnp.bfloat16, execution=Execution.decode(args.kernels))
    out = {"w4a16": (jax.jit(lambda q, s: decode(q, Decoder(rt, W4A16, tensor_parallel=tp), s), donate_argnums=1),
                     None)}
    for draft in args.drafts:
        spec = parse_draft(draft)
        rt_d = spec.runtime(rt)
        local = sharding.local_runtime(rt_d, tp) if tp > 1 else rt_d
        for g in args.gammas:
            replay = jnp.asarray(draft_rounds(table, draft)[str(g)], jnp.int32)

            def body(q, s, r, g=g, p=parse_precision(spec.mode), rt=local):
                return replay_loop(q, s, r, rt=rt, gamma=g, draft=p)

            run = ((lambda q, s, body=body, r=replay: sharding.run_sharded(body, tp, q, s, r)) if tp > 1
                   else (lambda q, s, body=body, r=replay: body(q, s, r)))
            out[f"qspec {draft} g={g}"] = (jax.jit(run, donate_argnums=1), spec.kv)
    return out


def _psum_loop(tp: int, count: int):
    """A jitted ``f(x) -> x`` running ``count`` chained all-reduces of ``x`` (replicated) over ``tp`` shards."""
    def body(x):
        return jax.lax.fori_loop(0, count, lambda i, v: jax.lax.psum(v, sharding.TP_AXIS) * (1.0 / tp), x)
    return jax.jit(jax.shard_map(body, mesh=sharding.mesh(tp), in_specs=P(), out_specs=P(), check_vma=False))


def probe_bytes() -> int:
    """Bytes of the large all-reduce :func:`bus_bandwidth` times on this backend."""
    return 4 * LARGE_ALLREDUCE.get(jax.default_backend(), LARGE_ALLREDUCE["cpu"])


def bus_bandwidth(tp: int) -> float:
    """Bytes per second a ring all-reduce moves per device (2 (N - 1) / N x the message) on a large message."""
    x = jnp.ones((probe_bytes() // 4,), jnp.float32)
    f = _psum_loop(tp, 10)
    return 10 * ring_bytes(x.nbytes, tp) / best_seconds(lambda _: f(x))


def ring_bytes(message: int, tp: int) -> float:
    return 2 * (tp - 1) / tp * message


def allreduce_ms_per_step(cfg, batch: int, tp: int, steps: int = 16) -> float:
    """Milliseconds of one decode step's all-reduces: 2 x layers of ``[batch, hidden]`` float32, timed
    over ``steps`` steps' worth in one loop."""
    x = jnp.ones((batch, cfg.hidden_size), jnp.float32)
    f = _psum_loop(tp, 2 * cfg.num_layers * steps)
    return 1e3 * best_seconds(lambda _: f(x)) / steps


def measure(name: str, context: int, batch: int, args, table: dict, bus_bw: float, limit: float) -> dict:
    cfg = MODELS[name]
    need = memory_need(matmul_flops_per_token(cfg) / 4, cfg, context, batch, args, w16a16=False)
    res = {"model": name, "context": context, "batch": batch, "new": args.new, "tp": args.tp, "methods": {}}
    if need / args.tp > limit:
        return res | {"skipped": f"needs ~{need / 1e9:.0f} GB, more than {args.tp} x {limit / 1e9:.0f} GB"}
    gmax = max(args.gammas) if args.drafts else 0
    params = random_params(cfg, jax.random.key(1))
    sharding.check(cfg, args.tp, None, params)
    degrees = [1, args.tp] if need <= limit else [args.tp]
    if need > limit:
        res["single_device"] = f"needs ~{need / 1e9:.0f} GB, more than the {limit / 1e9:.0f} GB of one device"
    for tp in degrees:
        if tp > 1:  # one copy on the devices at a time
            host = jax.device_get(params)
            del params
            params = sharding.shard_params(host, cfg, tp)
            del host
        for method, (loop, bits) in loops(cfg, tp, args, table).items():
            def make(bits=bits, tp=tp):
                return placed(fresh_state(cfg, batch, context, args.new, gmax, 0, bits), tp)
            secs, out = time_loop(loop, params, make, args.new, args.reps)
            entry = res["methods"].setdefault(method, {})
            entry[f"tokens_per_s_tp{tp}"] = batch * args.new / secs
            if method.startswith("qspec "):
                entry[f"tokens_per_round_tp{tp}"] = args.new / float(jax.device_get(out.rounds).mean())
            del out
    for entry in res["methods"].values():
        if "tokens_per_s_tp1" in entry:
            entry["speedup_vs_one"] = entry[f"tokens_per_s_tp{args.tp}"] / entry["tokens_per_s_tp1"]
            entry["efficiency"] = entry["speedup_vs_one"] / args.tp
    base = res["methods"]["w4a16"][f"tokens_per_s_tp{args.tp}"]
    for method, entry in res["methods"].items():
        entry["vs_w4a16"] = entry[f"tokens_per_s_tp{args.tp}"] / base
    res["allreduce_ms_per_step"] = allreduce_ms_per_step(cfg, batch, args.tp)
    step_bytes = 2 * cfg.num_layers * ring_bytes(batch * cfg.hidden_size * 4, args.tp)
    res["allreduce_floor_ms"] = 1e3 * step_bytes / bus_bw
    return res


def markdown(run: dict) -> str:
    n = run["tp"]
    lines = [f"# Tensor-parallel decode ({n} x {run['device']})", "",
             f"`{run['command']}`", "",
             f"{run['date']}, commit {run['commit']}, kernels {run['kernels']}. Random INT4 weights (symmetric, "
             f"group 128); QSPEC's acceptance **replayed** from {run['trace_source']}. All-reduce bus bandwidth "
             f"{run['bus_bandwidth'] / 1e9:.1f} GB/s (a {run['bus_probe_bytes'] / 2**20:.0f} MiB all-reduce, this "
             "run). Efficiency: the speed-up over one device / N. All-reduce: a decode step's 2 x layers psums "
             "of [batch, hidden] float32 timed alone, against the ring floor at that bandwidth.", "",
             f"| model | context | batch | method | tok/s TP={n} | tok/s TP=1 | speed-up | efficiency | vs W4A16 "
             "| all-reduce ms/step | floor ms | x floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in run["results"]:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | skipped: {r['skipped']} "
                         "| | | | | | | | |")
            continue
        for i, (method, e) in enumerate(r["methods"].items()):
            one = (f"{e['tokens_per_s_tp1']:.0f} | {e['speedup_vs_one']:.2f}× | {100 * e['efficiency']:.0f}%"
                   if "tokens_per_s_tp1" in e else "does not fit | n/a | n/a")
            ar = (f"{r['allreduce_ms_per_step']:.3f} | {r['allreduce_floor_ms']:.3f} | "
                  f"{r['allreduce_ms_per_step'] / r['allreduce_floor_ms']:.1f}" if i == 0 else " | | ")
            lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | {method} | "
                         f"{e[f'tokens_per_s_tp{n}']:.0f} | {one} | {e['vs_w4a16']:.2f}× | {ar} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=at_least(2), required=True, help="shards (devices), >= 2")
    ap.add_argument("--models", default="llama2-13b,llama2-70b")
    ap.add_argument("--batches", type=int_list(), default="1,8,16")
    ap.add_argument("--contexts", type=int_list(), default="512,4096")
    ap.add_argument("--new", type=positive_int, default=512)
    ap.add_argument("--drafts", default="w4a8")
    ap.add_argument("--gammas", type=int_list(), default="3")
    ap.add_argument("--trace", type=Path, help="acceptance trace JSON (bench.decode --record-trace)")
    ap.add_argument("--reps", type=positive_int, default=1)
    ap.add_argument("--kernels", default="auto", choices=KERNELS)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    args = ap.parse_args(argv)
    args.models = [n for n in args.models.split(",") if n]
    if unknown := [n for n in args.models if n not in MODELS]:
        ap.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    args.drafts = [d for d in args.drafts.split(",") if d]
    for d in args.drafts:
        try:
            spec = parse_draft(d)
        except ValueError as e:
            ap.error(str(e))
        if spec.head:
            ap.error(f"--drafts {d}: draft heads are not sharded; take MODE[/kvBITS][/winSIZE[+SINKS]]")
    if args.drafts and args.trace is None:
        ap.error("QSPEC on random weights needs --trace (its acceptance is replayed)")
    args.ar = ["w4a16"]  # what memory_need counts
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tp > jax.device_count():
        raise SystemExit(f"--tp {args.tp} needs {args.tp} devices; JAX sees {jax.device_count()} "
                         f"({jax.default_backend()})")
    trace = read_json(args.trace, "--trace") if args.trace else {}
    tables = {c: trace_rows(trace, c)[1] if args.drafts else {} for c in args.contexts}
    for c, table in tables.items():  # before anything is measured
        for d in args.drafts:
            if missing := [g for g in args.gammas if str(g) not in (draft_rounds(table, d) or {})]:
                raise SystemExit(f"the trace {args.trace} has no {d} rounds for gamma {missing} at context {c}")
    bus_bw, limit = bus_bandwidth(args.tp), memory_limit()
    run = {"command": command_line("bench.tp", argv), "device": jax.devices()[0].device_kind, "tp": args.tp,
           "date": utc_now(), "commit": git_commit(), "jax": jax.__version__, "kernels": resolve_kernels(args.kernels),
           "trace_source": trace.get("source", "-"), "bus_bandwidth": bus_bw, "bus_probe_bytes": probe_bytes(),
           "results": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        for context in args.contexts:
            for batch in args.batches:
                r = measure(name, context, batch, args, tables[context], bus_bw, limit)
                run["results"].append(r)
                print(f"{name} ctx={context} B={batch}: " + (r["skipped"] if "skipped" in r else ", ".join(
                    f"{m} {e[f'tokens_per_s_tp{args.tp}']:.0f} tok/s" for m, e in r["methods"].items())), flush=True)
                (args.out / "tp.json").write_text(json.dumps(run, indent=1))
                (args.out / "tp.md").write_text(markdown(run))


if __name__ == "__main__":
    sys.exit(main())
