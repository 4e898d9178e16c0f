"""End-to-end decode throughput: W16A16 (XLA bf16), W4A16 / W4A8 / W4A4 autoregressive, and QSPEC
(both draft precisions, several gamma), for Llama-shaped models with random weights.

    PYTHONPATH=. python3 -m bench.decode --trace bench/results/acceptance_trace.json \
        [--models llama3-8b,llama2-7b,llama2-13b] [--batches 1,8,16,32,64] [--contexts 512]
        [--new 512] [--gammas 1,3,5] [--drafts w4a8,w4a4,w4a8/kv8] [--out DIR] [--resume OLD.json] [--budget-s 480]
        [--threads 8] [--reps 1] [--label TEXT] [--rerun] [--shard I/N]
    python -m bench.decode --record-trace bench/results/acceptance_trace.json \
        --gsm8k ../shared/data/gsm8k_test_dev.jsonl      # the trace, on SmolLM2's real weights

``--models smollm2`` (with ``--gsm8k`` and ``--gsm8k-train``): the embedded SmolLM2 (or
``--checkpoint``) on real prompts (GSM8K-dev questions after as many few-shot train examples as fit
in the context, chat template, prefilled), QSPEC with its own accept decisions.

Per (model, context P, batch B): a decode state holding P committed tokens per sequence is made
directly (random tokens, a zeroed KV cache: decode time does not depend on the values), then each
method generates ``--new`` tokens in its jitted ``while_loop`` (a configuration's loops are all
compiled first, the Pallas ones ``--threads`` at once, then the plain-XLA baseline alone, and nothing
compiles while anything is timed: session 13's runs that compiled the next configuration meanwhile
timed phases up to 1.8x too slow; each loop is timed on a fresh state after a warm-up run of a few
tokens): tokens/s, ms per step (AR) or
per round (QSPEC), and the ratio to W4A16 AR measured in the same run. QSPEC's accept decisions are
**replayed** from a per-round accepted-draft trace recorded on SmolLM2's real weights
(``--record-trace``; every draft step and verify pass still runs, only the accept decision is
replayed): random weights would accept nothing. A draft ``MODE/kvBITS`` reads an INT8 / INT4
shadow of the KV cache (``generate(draft_kv=...)``; its trace recorded with that shadow).

Phases: one draft step (1 token per sequence, draft mode) and one verify pass (gamma + 1 tokens,
W4A16) timed alone; the rest of a round (one iteration of the batch's loop) is overhead. The
speed-up model of DESIGN.md §2, ``S = E[L] * T_w4a16 / (gamma * T_draft + T_verify + T_overhead)``
with E[L] the measured tokens per round (the sequences' mean), stands next to the measured
speed-up. The loop runs until its slowest sequence is done: the batch tail, iterations / the
sequences' mean rounds, is what separates the two (measured ≈ S / tail). Beside it, the same model
fed with the measured acceptance rate alpha, E[L] = (1 - alpha**(gamma+1)) / (1 - alpha):
DESIGN.md's formula as written, which assumes independent accepts. Floor per
step: the bytes one W4A16 step must move (packed weights + scales + bf16 lm_head + the KV cache
read) over the copy bandwidth measured in the same run. Phase floors: a draft step or verify pass
cannot beat the larger of that byte floor and its matmul FLOPs (2 x the matmul weights per token,
attention left out) over the dense matmul rate measured in the same run (XLA's bf16 dot for the
W4A16 verify, its int8 dot for a W4A8 / W4A4 draft); each phase is reported as a multiple of its
floor. Memory per method (paper Table 5): the buffers its compiled decode loop needs, from XLA's
buffer assignment (weights, decode state, outputs and temporaries; a donated state counted once;
constants inside the executable left out).

Writes ``decode.json`` / ``decode.md`` under ``--out`` (default ``$OUT``, else bench/results), after
every configuration. ``--resume OLD.json`` continues an earlier run: its configurations are kept and
not run again (so a matrix larger than one device call is measured over several calls), except with
``--rerun``, where the configurations this call names are measured again and replace the old ones
(unless the new one comes out disturbed and the old one is valid);
``--budget-s``: no configuration starts that would not end within that many seconds (its
:func:`config_cost_s` estimate times the slowest measured / estimated ratio of the call so far,
:data:`PACE` before the first). A section whose QSPEC rounds come out more than
:data:`PHASE_SLACK` shorter than their timed phases is marked ``disturbed`` (:func:`phase_check`: not a
valid measurement; decode.md says so, bench.plot leaves it out, ``--resume`` measures it again); ``--label``: a note on the code
measured, kept with each new section; ``--shard I/N``: only share I of N of the configurations left
to measure, split by estimated cost (one GPU's share; ``bench.decode_gpus`` runs all N and merges).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# the benchmark owns the GPU: let XLA take 95% of it (its default 75% of an H200 runs the 13B and
# MHA 7B caches at batch 64 out of memory)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.args import command_line, int_list, positive_int, positive_seconds, read_gsm8k, read_json  # noqa: E402
from bench.hooks import acceptance_trace, replay_loop, unstack_layers  # noqa: E402
from convert.embedded import default_checkpoint  # noqa: E402
from pallas_kernels.layout import QuantizedWeight, dequantize  # noqa: E402
from pallas_kernels.precision import W4A16, parse_precision  # noqa: E402
from pallas_kernels.reference import KV_BITS  # noqa: E402
from qspec_jax.api import DRAFTS, METHODS, cache_slots, load  # noqa: E402
from qspec_jax.config import LlamaConfig  # noqa: E402
from qspec_jax.kernels import KERNELS, Execution, resolve_kernels  # noqa: E402
from qspec_jax.decode import DecodeState, Runtime, ar_loop, prefill_jit  # noqa: E402
from qspec_jax.model import init_cache  # noqa: E402
from qspec_jax.qspec import qspec_loop  # noqa: E402
from qspec_jax.sampling import Sampling  # noqa: E402

MODELS = {
    "llama2-7b": LlamaConfig(32000, 4096, 11008, 32, 32, 32, 128, max_position_embeddings=8192),
    "llama3-8b": LlamaConfig(128256, 4096, 14336, 32, 32, 8, 128, rope_theta=500000.0, max_position_embeddings=8192),
    "llama2-13b": LlamaConfig(32000, 5120, 13824, 40, 40, 40, 128, max_position_embeddings=8192),
    "smoke": LlamaConfig(256, 128, 256, 2, 4, 2, 32, max_position_embeddings=1024),
}
GROUP = 128  # random weights: symmetric, group 128
REAL_MODEL = "smollm2"  # the embedded model (or --checkpoint) with real prompts and real acceptance
MEM_LIMIT = 125e9  # skip a configuration whose weights + 1.5 x its KV cache (a state and a loop's copy) exceed this
FORWARD_REPS = 16  # forwards per timed phase loop
WARM_TOKENS = 4  # tokens per sequence a decode loop's warm-up run generates
# a configuration's seconds / its config_cost_s before one is measured: 1.0-3.5 in sessions 10-13, the
# most where its compile is a large share (Llama-3-8B, batch 1)
PACE = 3.5
# a round (one loop iteration) cannot be shorter than its gamma draft steps and its verify, each timed
# alone; sections timed alone came within 3% of that, those timed beside a compile up to -112%
# (bench/results/decode_timing_check.md)
PHASE_SLACK = 0.05


def log(*a: Any) -> None:
    print(*a, flush=True)


# ------------------------------------------------------------------------------ model and state

def _packed(key, layers: int, n: int, k: int) -> QuantizedWeight:
    k1, k2 = jax.random.split(key)
    packed = jax.random.bits(k1, (layers, n, k // 2), jnp.uint8)
    scales = jax.random.uniform(k2, (layers, n, k // GROUP), jnp.float32, 0.001, 0.01).astype(jnp.float16)
    return QuantizedWeight(packed, scales, None, GROUP)


def random_params(cfg: LlamaConfig, key: jax.Array) -> dict:
    """A packed-INT4 params pytree in the converter's layout, random (symmetric, group 128)."""
    ks = jax.random.split(key, 6)
    h, f, l = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    ones = jnp.ones((l, h), jnp.bfloat16)
    return {
        "embed": (0.02 * jax.random.normal(ks[0], (cfg.vocab_size, h))).astype(jnp.bfloat16),
        "layers": {"attn_norm": {"scale": ones}, "mlp_norm": {"scale": ones},
                   "attn": {"qkv": {"w": _packed(ks[1], l, qkv, h)},
                            "o": {"w": _packed(ks[2], l, h, cfg.num_heads * cfg.head_dim)}},
                   "mlp": {"gate_up": {"w": _packed(ks[3], l, 2 * f, h)}, "down": {"w": _packed(ks[4], l, h, f)}}},
        "final_norm": {"scale": jnp.ones((h,), jnp.bfloat16)},
        "lm_head": (0.02 * jax.random.normal(ks[5], (cfg.vocab_size, h))).astype(jnp.bfloat16),
    }


def float_params(params: dict) -> dict:
    """The same weights dequantized to bf16, one tree per layer (the W16A16 baseline runs plain XLA
    dots, which would copy a layer out of a stack first: :func:`bench.hooks.unstack_layers`)."""
    return unstack_layers(jax.tree.map(lambda a: dequantize(a, jnp.bfloat16) if isinstance(a, QuantizedWeight) else a,
                                       params, is_leaf=lambda a: isinstance(a, QuantizedWeight)))


def weight_bytes(params: dict) -> int:
    """Bytes one step reads: every weight but the embedding table (unless it is tied, read as the lm_head)."""
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    return int(total - params["embed"].nbytes if "lm_head" in params else total)


def matmul_flops_per_token(cfg: LlamaConfig) -> int:
    """2 x the weights every token multiplies (qkv, o, gate/up, down per layer, and the lm_head)."""
    qkv = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    o = cfg.num_heads * cfg.head_dim * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return 2 * (cfg.num_layers * (qkv + o + mlp) + cfg.vocab_size * cfg.hidden_size)


def kv_bytes(cfg: LlamaConfig, batch: int, slots: int) -> int:
    return 2 * cfg.num_layers * batch * slots * cfg.num_kv_heads * cfg.head_dim * 2


def config_cost_s(name: str, context: int, batch: int, args) -> float:
    """A rough estimate of one configuration's seconds (its compiles, then every decode loop at the
    bytes-floor step time; about 0 for one too large for :data:`MEM_LIMIT`, which is skipped): to
    balance ``--shard``'s split, and scaled by the measured pace, for ``--budget-s`` (:class:`Budget`)."""
    loops = len(args.ar) + len(args.drafts) * len(args.gammas)
    if name == REAL_MODEL:  # a 135M model: launch-bound steps of a few ms, ~1 min in session 12
        return 20.0 + loops * args.new * 4e-3
    cfg = MODELS[name]
    packed = matmul_flops_per_token(cfg) / 4  # ~ the INT4 weights' bytes (half a byte per weight)
    if memory_need(packed, cfg, context, batch, args) > MEM_LIMIT:  # _bench_model's test, on estimated bytes
        return 0.0
    return 20.0 + loops * args.new * (packed + kv_bytes(cfg, batch, context + args.new // 2)) / 4e12


def memory_need(weight_bytes: float, cfg: LlamaConfig, context: int, batch: int, args) -> float:
    """Device bytes one configuration needs, estimated: the weights (three times with the W16A16
    baseline's bf16 copy), 1.5 x the KV cache (a state and a loop's copy), and the draft's shadow."""
    kv = kv_bytes(cfg, batch, context + args.new + 64)
    shadow = max([parse_draft(d)[1] or 0 for d in args.drafts] + [0]) / 16  # a shadow's bytes per cache byte
    return weight_bytes * (3 if "w16a16" in args.ar else 1) + 1.5 * kv + (kv * (shadow + 1 / 32) if shadow else 0)


def split_by_cost(items: list, cost, parts: int) -> list[list]:
    """``items`` in ``parts`` lists of near-equal total ``cost``: the costliest first, each to the
    least loaded list (longest processing time first); deterministic, so every shard computes the
    same split."""
    out: list[list] = [[] for _ in range(parts)]
    loads = [0.0] * parts
    for item in sorted(items, key=cost, reverse=True):
        i = loads.index(min(loads))
        out[i].append(item)
        loads[i] += cost(item)
    return out


def parse_shard(spec: str) -> tuple[int, int]:
    """``--shard I/N``: ``(I, N)`` with 0 <= I < N."""
    i, slash, n = spec.partition("/")
    if not (slash and i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"--shard takes I/N with 0 <= I < N, got {spec!r}")
    return int(i), int(n)


def parse_draft(spec: str, modes: tuple[str, ...] = DRAFTS) -> tuple[str, int | None]:
    """A ``--drafts`` entry, ``MODE`` or ``MODE/kvBITS`` (the drafts read an INT8 / INT4 KV shadow):
    ``(mode, bits or None)``; ``modes``: the modes allowed."""
    mode, slash, kv = spec.partition("/")
    bits = next((b for b in KV_BITS if kv == f"kv{b}"), None)
    if mode not in modes or (slash and bits not in KV_BITS):
        raise ValueError(f"unknown draft {spec!r}: expected one of {', '.join(modes)}, optionally followed by "
                         f"{' or '.join(f'/kv{b}' for b in KV_BITS)}")
    return mode, bits


def expected_tokens(alpha: float, gamma: int) -> float:
    """DESIGN.md §2's ``E[L] = (1 - alpha**(gamma+1)) / (1 - alpha)``: tokens per round when each
    draft is accepted independently with probability ``alpha``."""
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def fresh_state(cfg: LlamaConfig, batch: int, context: int, new: int, gamma: int, seed: int,
                shadow_bits: int | None = None) -> DecodeState:
    """``context`` committed tokens per sequence (random), a zeroed bf16 KV cache (and its
    ``shadow_bits`` shadow) sized for ``new`` more tokens plus a QSPEC round."""
    buffer_len = context + new + gamma + 1
    slots = cache_slots(buffer_len)
    key = jax.random.key(seed)
    tokens = jax.random.randint(key, (batch, buffer_len), 0, cfg.vocab_size, jnp.int32)
    zeros = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731  (distinct buffers: the state is donated)
    lengths = lambda: jnp.full((batch,), context, jnp.int32)  # noqa: E731
    return DecodeState(tokens, lengths(), lengths(), zeros(), init_cache(cfg, batch, slots, jnp.bfloat16, shadow_bits),
                       key, zeros(), zeros(), zeros())


def fewshot_prompts(model, dev: Path, train: Path, batch: int, context: int) -> list[list[int]]:
    """``batch`` real prompts of at most ``context`` tokens: GSM8K-dev questions in the chat template,
    each after as many GSM8K-train question/answer pairs as fit (few-shot, in one user turn)."""
    from qspec_jax.tokenizer import chat_prompt

    questions, shots = read_gsm8k(dev, answers=False), read_gsm8k(train)
    out = []
    for i in range(batch):
        question = f"Question: {questions[i % len(questions)]['question']}\nAnswer:"
        ids = chat_prompt(model.tokenizer, question)
        if len(ids) > context:
            raise ValueError(f"a GSM8K question alone is {len(ids)} tokens, more than the context {context}")
        prefix = ""
        for j in range(len(shots)):
            shot = shots[(7 * i + j) % len(shots)]
            prefix += f"Question: {shot['question']}\nAnswer: {shot['answer']}\n\n"
            longer = chat_prompt(model.tokenizer, prefix + question)
            if len(longer) > context:
                break
            ids = longer
        out.append(ids)
    return out


def real_state_maker(model, rt: Runtime, prompts: list[list[int]], new: int, gamma: int):
    """A function making a fresh decode state: ``prompts`` prefilled (W4A16) with room for ``new``
    tokens plus a QSPEC round."""
    from qspec_jax.decode import pad_prompts

    tokens, lengths = pad_prompts(prompts)
    buf = int(lengths.max()) + new + gamma + 1
    return lambda: prefill_jit(model.checkpoint.params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                               rt=rt, buffer_len=buf, cache_len=cache_slots(buf), precision=W4A16)


# ------------------------------------------------------------------------------ timing

def compile_all(jobs: dict[Any, tuple[Any, tuple]], threads: int) -> dict[Any, Any]:
    """``{key: (jitted fn, abstract args)}`` -> ``{key: compiled}``: each lowered here, compiled in a
    pool of ``threads`` (a configuration's dozen decode loops compile at once)."""
    with ThreadPoolExecutor(max(1, threads)) as pool:
        futures = {key: pool.submit(fn.lower(*a).compile) for key, (fn, a) in jobs.items()}
    return {key: f.result() for key, f in futures.items()}


def time_loop(compiled, params, make_state, new: int, reps: int = 1) -> tuple[float, DecodeState]:
    """Seconds of one compiled decode loop ``compiled(params, state)``: best of ``reps`` runs, each on
    a fresh state, after a warm-up run of the same executable on a state that starts with all but
    :data:`WARM_TOKENS` of its ``new`` tokens counted as generated (so it stops after a few steps)."""
    warm = make_state()
    warm = dataclasses.replace(warm, prompt_lengths=warm.prompt_lengths - max(new - WARM_TOKENS, 0))
    jax.block_until_ready(compiled(params, warm))
    best, out = float("inf"), None
    for _ in range(reps):
        out = None  # the previous run's state is freed before the next one is made
        st = jax.block_until_ready(make_state())
        t = time.perf_counter()
        out = jax.block_until_ready(compiled(params, st))
        best = min(best, time.perf_counter() - t)
    return best, out


def forward_loop(rt: Runtime, mode: str, reps: int, read_shadow: bool = False):
    """A jitted ``f(params, carry) -> carry`` running ``reps`` decode-time forwards in one
    ``fori_loop`` (no host dispatch between them, as inside the decode loops; the argmax feeds the
    next forward, so the lm_head is not dead code); ``carry`` is :func:`forward_carry`'s."""

    def many(p, carry):
        def one(i, carry):
            toks, pos, c = carry
            logits, c = rt.run(p, toks, pos, c, parse_precision(mode), read_shadow=read_shadow)
            return jnp.argmax(logits, axis=-1).astype(toks.dtype), pos, c

        return jax.lax.fori_loop(0, reps, one, carry)

    return jax.jit(many, donate_argnums=1)


def forward_carry(state: DecodeState, tokens: int, ahead: int = 0) -> tuple:
    """``(tokens, positions, cache)`` for :func:`forward_loop`: ``tokens`` new tokens per sequence,
    ``ahead`` positions after the state's committed ones (the phases are timed at the decode loops'
    mean context, prompt + new / 2, where the floors are counted)."""
    positions = state.lengths[:, None] + ahead + jnp.arange(tokens)[None]
    return state.tokens[:, :tokens], positions, state.cache


def time_forward(compiled, params, carry, reps: int) -> float:
    """ms of one forward of a compiled :func:`forward_loop` of ``reps`` forwards: warm-up, then best of 3."""
    carry = jax.block_until_ready(compiled(params, carry))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        carry = jax.block_until_ready(compiled(params, carry))
        best = min(best, time.perf_counter() - t)
    return 1e3 * best / reps


def _best_seconds(call: Callable[[], Any], repeats: int = 5) -> float:
    """The fastest of ``repeats`` wall-clock timings of ``call()`` after one warm-up call (a single
    sample can be slowed by the host: one session-20 copy measured 3.05 TB/s, every other 3.9-4.1)."""
    jax.block_until_ready(call())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(call())
        best = min(best, time.perf_counter() - t)
    return best


def copy_bandwidth() -> float:
    """Bytes per second of a float32 ``a + 1`` (read + write; 1 GiB on a GPU, 4 MiB elsewhere, where
    only the tests run it), 10 calls in a row, best of 5: the denominator of the bytes floors."""
    a = jnp.zeros((1 << 28 if jax.default_backend() == "gpu" else 1 << 20,), jnp.float32)
    f = jax.jit(lambda v: v + 1.0)

    def ten_calls() -> jax.Array:
        v = a
        for _ in range(10):
            v = f(v)
        return v

    return 10 * 8 * a.size / _best_seconds(ten_calls)


def matmul_rates() -> dict[str, float]:
    """Dense matmul rate (FLOP/s) of XLA's bf16 dot and its int8 -> int32 dot on square operands
    (8192 on a GPU, 256 elsewhere), best of 5: the compute roof of the phase floors."""
    n = 8192 if jax.default_backend() == "gpu" else 256
    rates = {}
    for name, dtype, acc in (("bf16", jnp.bfloat16, jnp.float32), ("int8", jnp.int8, jnp.int32)):
        a = jnp.ones((n, n), dtype)
        f = jax.jit(lambda x, y, acc=acc: jnp.dot(x, y, preferred_element_type=acc))
        rates[name] = 2 * n**3 / _best_seconds(lambda: f(a, a))
    return rates


def loop_memory_bytes(compiled) -> int:
    """Device bytes a compiled program needs: its arguments, outputs (less those aliasing a donated
    argument) and temporaries, from XLA's buffer assignment."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


# ------------------------------------------------------------------------------ one configuration

KERNELS_MEASURED = "pallas"  # what a section that does not record its kernels (before session 28) ran on
XLA_JOB = ("ar", "w16a16")  # plain XLA: its dots autotune on the GPU while it compiles


@dataclasses.dataclass
class Config:
    """One (model, context, batch): its decode loops and phase forwards as ``{key: (jitted fn, abstract
    args)}`` (:func:`plan_config`), to compile (:func:`compile_config`) and then time (:func:`run_config`)."""

    res: dict  # the result, filled in by run_config
    rt: Runtime
    makes: dict  # KV shadow bits (None: none) -> () -> a fresh DecodeState
    jobs: dict
    ahead: int  # phase forwards start this many positions after the prompt


def plan_config(name: str, cfg: LlamaConfig, params: dict, fparams: dict | None, batch: int, context: int,
                args, trace: dict | None, bw: float, model=None) -> Config:
    """Every method's program at one (model, context, batch), not yet compiled. ``model`` (real
    weights): states prefilled from real prompts and QSPEC's own accept decisions (``trace`` None);
    otherwise random states and the trace's accept decisions replayed."""
    res: dict = {"model": name, "batch": batch, "context": context, "new": args.new, "methods": {},
                 "acceptance": "replayed" if model is None else "measured", "kernels": resolve_kernels(args.kernels)}
    gmax = max(args.gammas)
    rt = Runtime(cfg, args.new, (), Sampling(), jnp.bfloat16,
                 None if model is None else model.checkpoint.online_rotation_seed, Execution.decode(args.kernels))
    if model is not None:
        prompts = fewshot_prompts(model, args.gsm8k, args.gsm8k_train, batch, context)
        res["prompt_tokens"] = float(np.mean([len(p) for p in prompts]))

    def maker(bits: int | None):
        if model is None:
            return lambda: fresh_state(cfg, batch, context, args.new, gmax, 0, bits)
        return real_state_maker(model, dataclasses.replace(rt, draft_kv=bits), prompts, args.new, gmax)

    makes = {bits: maker(bits) for bits in {None, *(parse_draft(d)[1] for d in args.drafts)}}
    state = jax.eval_shape(makes[None])  # abstract: for lowering
    ahead = args.new // 2  # the phases are timed at the loops' mean context, where the floors are counted
    carry = lambda t, bits=None: jax.eval_shape(lambda: forward_carry(makes[bits](), t, ahead))  # noqa: E731
    prompt = res.get("prompt_tokens", context)  # the real prompts fill the context only up to a shot
    res["weight_bytes"], res["kv_read_bytes"] = weight_bytes(params), kv_bytes(cfg, batch, round(prompt) + ahead)
    res["floor_ms_per_step"] = 1e3 * (res["weight_bytes"] + res["kv_read_bytes"]) / bw
    res["phase_context"] = round(prompt) + ahead  # where forward_ms times the phases
    res["copy_bw"] = bw
    res["cache_bytes"] = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.cache))
    jobs: dict = {}
    for method in _ar_methods(args, fparams):
        p = fparams if method == "w16a16" else params
        # the W16A16 baseline is plain XLA (bf16 dots, XLA attention), not row-count invariant
        rt_m = dataclasses.replace(rt, execution=Execution.prefill("reference")) if method == "w16a16" else rt
        jobs["ar", method] = (jax.jit(lambda q, s, rt_m=rt_m, p=parse_precision(method): ar_loop(q, s, rt=rt_m,
                                                                                               precision=p),
                                      donate_argnums=1), (p, state))
    if args.drafts and ("ar", "w4a16") in jobs:
        jobs["fwd", "w4a16", 1, None] = (forward_loop(rt, "w4a16", FORWARD_REPS), (params, carry(1)))
    for draft in args.drafts:
        mode, bits = parse_draft(draft)
        rt_d, state_d = dataclasses.replace(rt, draft_kv=bits), jax.eval_shape(makes[bits])
        jobs["fwd", mode, 1, bits] = (forward_loop(rt_d, mode, FORWARD_REPS, bits is not None), (params, carry(1, bits)))
        for g in args.gammas:
            replay = None if trace is None else jnp.asarray(trace[draft][str(g)], jnp.int32)
            jobs["qspec", draft, g] = (jax.jit(lambda q, s, g=g, p=parse_precision(mode), rt_d=rt_d, replay=replay: (
                qspec_loop(q, s, rt=rt_d, gamma=g, draft=p) if replay is None
                else replay_loop(q, s, replay, rt=rt_d, gamma=g, draft=p)), donate_argnums=1), (params, state_d))
            # the verify on the draft's state: with a shadow, its re-quantization (sync_shadow) included
            jobs["fwd", "w4a16", g + 1, bits] = (forward_loop(rt_d, "w4a16", FORWARD_REPS), (params, carry(g + 1, bits)))
    return Config(res, rt, makes, jobs, ahead)


def _ar_methods(args, fparams: dict | None) -> list[str]:
    return [m for m in args.ar if m != "w16a16" or fparams is not None]


def compile_config(c: Config, threads: int) -> dict:
    """``c``'s programs compiled: the Pallas ones ``threads`` at once, then the plain-XLA baseline
    alone (its autotuning times kernels on the GPU, so nothing else may run meanwhile)."""
    compiled = compile_all({k: v for k, v in c.jobs.items() if k != XLA_JOB}, threads)
    return compiled | compile_all({k: v for k, v in c.jobs.items() if k == XLA_JOB}, 1)


@dataclasses.dataclass
class Budget:
    """``--budget-s``: a configuration starts only if its estimated seconds (:func:`config_cost_s`
    times :meth:`pace`) end before ``deadline``."""

    deadline: float
    slowest: float | None = None  # the largest measured / estimated ratio of this call so far

    def pace(self) -> float:
        """The slowest measured / estimated ratio so far, :data:`PACE` before the first."""
        return PACE if self.slowest is None else self.slowest

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, estimate_s: float) -> bool:
        return self.pace() * estimate_s <= self.left()

    def measured(self, estimate_s: float, seconds: float) -> None:
        if estimate_s > 0:
            self.slowest = max(self.slowest or 0.0, seconds / estimate_s)


def phase_check(res: dict) -> str | None:
    """Why ``res`` is not a valid measurement, or None: a QSPEC round more than :data:`PHASE_SLACK`
    shorter than the gamma draft steps and the verify it is made of, each timed alone (they were
    slowed, e.g. by a compile beside them)."""
    worst = min(((e["overhead_ms"] / e["ms_per_round"], m) for m, e in res.get("methods", {}).items()
                 if "overhead_ms" in e), default=None)
    if worst is None or worst[0] >= -PHASE_SLACK:
        return None
    return (f"a QSPEC round came out {-100 * worst[0]:.0f}% shorter than its phases timed alone ({worst[1]}): "
            "the phases were slowed while they were timed")


def run_config(c: Config, compiled: dict, params: dict, fparams: dict | None, args, rates: dict[str, float]) -> dict:
    """Times ``c``'s compiled programs one by one: each method's decode loop, QSPEC's phases."""
    res, make, batch, ahead = c.res, c.makes[None], c.res["batch"], c.ahead
    floor_ms = res["floor_ms_per_step"]
    flops = matmul_flops_per_token(c.rt.config)

    def phase_floor_ms(tokens: int, mma: str, kv_bits: int | None = None) -> float:
        """The larger of the byte floor (the KV read from a ``kv_bits`` shadow: codes and a float32
        scale per key / value vector) and ``tokens`` tokens' matmul FLOPs at the measured rate."""
        kv = res["kv_read_bytes"] * (1 if kv_bits is None else kv_bits / 16 + 2 / c.rt.config.head_dim)
        return max(1e3 * (res["weight_bytes"] + kv) / res["copy_bw"], 1e3 * tokens * flops / rates[mma])

    def forward_ms(mode: str, tokens: int, bits: int | None = None) -> float:
        carry = forward_carry(c.makes[bits](), tokens, ahead)
        return time_forward(compiled["fwd", mode, tokens, bits], params, carry, FORWARD_REPS)

    for method in _ar_methods(args, fparams):
        # [0]: the loop's final state is dropped at once (held in a variable, a 70 GB cache would
        # still be alive when the next method makes its state: out of memory at 7B, batch 32, 3584)
        secs = time_loop(compiled["ar", method], fparams if method == "w16a16" else params, make, args.new,
                         args.reps)[0]
        res["methods"][method] = {"tokens_per_s": batch * args.new / secs, "ms_per_step": 1e3 * secs / args.new,
                                  "memory_bytes": loop_memory_bytes(compiled["ar", method])}
        log(f"  {method}: {res['methods'][method]['ms_per_step']:.2f} ms/step, "
            f"{res['methods'][method]['tokens_per_s']:.0f} tok/s (floor {floor_ms:.2f} ms/step)")
    base = res["methods"].get("w4a16", {}).get("ms_per_step")
    t_target = forward_ms("w4a16", 1) if ("fwd", "w4a16", 1, None) in compiled else None
    for draft in args.drafts:
        mode, bits = parse_draft(draft)
        t_draft = forward_ms(mode, 1, bits)
        for g in args.gammas:
            secs, out = time_loop(compiled["qspec", draft, g], params, c.makes[bits], args.new, args.reps)
            # a sequence counts the rounds it ran in; the loop runs until its slowest sequence is done
            rounds = np.asarray(out.rounds)
            alpha = int(np.asarray(out.accepted).sum()) / max(int(np.asarray(out.drafted).sum()), 1)
            del out  # its cache: the forward timings below make states of their own
            iterations, tail = int(rounds.max()), float(rounds.max() / rounds.mean())
            t_round = 1e3 * secs / iterations
            t_verify = forward_ms("w4a16", g + 1, bits)
            overhead = t_round - g * t_draft - t_verify
            tpr = args.new / float(rounds.mean())
            entry = {"tokens_per_s": batch * args.new / secs, "ms_per_round": t_round, "tokens_per_round": tpr,
                     "iterations": iterations, "tail": tail, "alpha": alpha,
                     "draft_ms": t_draft, "verify_ms": t_verify, "overhead_ms": overhead,
                     "draft_floor_ms": phase_floor_ms(batch, "int8", bits),
                     "verify_floor_ms": phase_floor_ms(batch * (g + 1), "bf16"),
                     "memory_bytes": loop_memory_bytes(compiled["qspec", draft, g])}
            if base and t_target:
                entry["speedup_vs_w4a16"] = base * args.new / (1e3 * secs)
                # DESIGN.md §2: E[L] * T_target / (gamma * T_draft + T_verify + T_overhead), that sum being t_round
                entry["model_speedup"] = tpr * t_target / t_round
                entry["model_speedup_alpha"] = expected_tokens(alpha, g) * t_target / t_round
            res["methods"][f"qspec {draft} g={g}"] = entry
            log(f"  qspec {draft} g={g}: {t_round:.2f} ms/round ({g} x {t_draft:.2f} draft + {t_verify:.2f} verify + "
                f"{overhead:.2f}), {tpr:.2f} tok/round, batch tail x{tail:.2f}, {entry['tokens_per_s']:.0f} tok/s, "
                f"x{entry.get('speedup_vs_w4a16', float('nan')):.2f} vs w4a16 ({res['acceptance']} acceptance)")
    return res


# ------------------------------------------------------------------------------ the trace

def record_trace(args) -> None:
    """Per-round accepted drafts of greedy QSPEC on SmolLM2 (GSM8K-dev prompts, chat template)."""
    from qspec_jax.api import tokenize

    model = load(args.checkpoint or default_checkpoint())
    ids = tokenize(model, [r["question"] for r in read_gsm8k(args.gsm8k, answers=False)[: args.prompts]], chat=True)
    cfg = model.config
    out: dict = {"source": "SmolLM2-135M-Instruct (embedded, default checkpoint), greedy, chat template, "
                           f"{len(ids)} GSM8K-dev prompts x {args.new} new tokens", "device": jax.devices()[0].device_kind}
    for draft in args.drafts:
        mode, bits = parse_draft(draft)
        out[draft] = {}
        for g in args.gammas:
            rt = Runtime(cfg, args.new, (), Sampling(), jnp.float32, model.checkpoint.online_rotation_seed,
                         Execution.decode(args.kernels), draft_kv=bits)
            st = real_state_maker(model, rt, ids, args.new, g)()
            tr = acceptance_trace(model.checkpoint.params, st, rt=rt, gamma=g, draft=parse_precision(mode))
            # each sequence's own rounds, cut to the shortest: no row of a finished sequence is replayed
            cols = [c[c >= 0] for c in tr.T]
            rounds = min(len(c) for c in cols)
            tr = np.stack([c[:rounds] for c in cols], axis=1)
            out[draft][str(g)] = tr.tolist()
            log(f"{draft} gamma={g}: {rounds} rounds kept, mean accepted {tr.mean():.2f} "
                f"({1 + tr.mean():.2f} tokens per round)")
    args.record_trace.parent.mkdir(parents=True, exist_ok=True)
    args.record_trace.write_text(json.dumps(out))


# ------------------------------------------------------------------------------ report

def _over_floor(e: dict) -> str:
    """``draft / verify`` time as multiples of their phase floors (absent in older runs)."""
    if "draft_floor_ms" not in e:
        return ""
    return f"{e['draft_ms'] / e['draft_floor_ms']:.2f} / {e['verify_ms'] / e['verify_floor_ms']:.2f}"


def markdown(run: dict) -> str:
    lines = [f"# Decode throughput ({run['device']})", "", f"`{run['command']}`", "",
             f"Copy bandwidth {run['copy_bw'] / 1e12:.2f} TB/s (this call; each section's floor uses its own "
             f"call's). Llama shapes: random weights (symmetric INT4, group {GROUP}), QSPEC acceptance "
             f"**replayed** from {run['trace_source']}; {REAL_MODEL}: real weights, few-shot GSM8K prompts, "
             "QSPEC's own (**measured**) acceptance. tok/s counts "
             "generated tokens of the whole batch; speed-ups are against W4A16 AR in the same run; "
             "floor = bytes one W4A16 step moves (weights + KV read at the mid context) / copy bandwidth; "
             "`x floor`: each QSPEC phase over the larger of that and its matmul FLOPs at the dense matmul rate "
             "(bf16 for the verify, int8 for the draft)"
             + (f", measured in this call at {run['matmul_rates']['bf16'] / 1e12:.0f} TFLOP/s bf16 and "
                f"{run['matmul_rates']['int8'] / 1e12:.0f} TOP/s int8" if "matmul_rates" in run else "")
             + ". A QSPEC round is one iteration of the batch's loop, which runs until its slowest sequence is "
             "done; tokens/round is the sequences' mean; batch tail = the loop's iterations / the sequences' "
             "mean rounds, so measured ≈ model / tail (sections measured before session 11 divided by the mean "
             "rounds: the tail is inside their overhead). α: the fraction of drafts accepted; model (α): DESIGN.md "
             "§2's model with E[L] = (1 - α^(γ+1)) / (1 - α), as if each draft were accepted independently, "
             "instead of the measured tokens per round.", ""]
    for r in run["results"]:
        acceptance = r.get("acceptance", "replayed")
        prompt = f"; prompts of {r['prompt_tokens']:.0f} tokens on average" if "prompt_tokens" in r else ""
        lines += [f"## {r['model']}, batch {r['batch']}, context {r['context']} + {r['new']}", "",
                  (f"Measured: {r['label']}. " if r.get("label") else "")
                  + f"W4A16 step floor {r['floor_ms_per_step']:.2f} ms; KV cache {r['cache_bytes'] / 1e9:.1f} GB"
                  + (f"; the process's peak GPU memory so far {r['peak_bytes'] / 1e9:.1f} GB" if r.get("peak_bytes") else "")
                  + prompt + "; QSPEC phases timed at context "
                  + (f"{r['phase_context']} (the loops' mean)" if "phase_context" in r else "= the prompt's end")
                  + (f"; measuring it took {r['bench_s']['compile_wait']:.0f} s waiting for compiles and "
                     f"{r['bench_s']['timing']:.0f} s of runs" if "bench_s" in r else ""), "",
                  *([f"**Not a valid measurement:** {r['disturbed']}", ""] if r.get("disturbed") else []),
                  "| method | tok/s | ms/step or round | tokens/round | α | batch tail | draft / verify / overhead ms | "
                  "draft / verify x floor | vs W4A16 | model | model (α) | memory GB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for m, e in r["methods"].items():
            mem = f"{e['memory_bytes'] / 1e9:.2f}" if "memory_bytes" in e else ""
            if "ms_per_step" in e:
                ratio = r["methods"].get("w4a16", {}).get("ms_per_step", float("nan")) / e["ms_per_step"]
                lines.append(f"| {m} | {e['tokens_per_s']:.0f} | {e['ms_per_step']:.2f} | 1 | | | | | {ratio:.2f}× "
                             f"| | | {mem} |")
            else:
                tail = f"{e['tail']:.2f}" if "tail" in e else "(in overhead)"
                alpha = f"{e['alpha']:.3f}" if "alpha" in e else ""
                model_alpha = f"{e['model_speedup_alpha']:.2f}×" if "model_speedup_alpha" in e else ""
                lines.append(f"| qspec {m[6:]} ({acceptance}) | {e['tokens_per_s']:.0f} | {e['ms_per_round']:.2f} | "
                             f"{e['tokens_per_round']:.2f} | {alpha} | {tail} | {e['draft_ms']:.2f} / {e['verify_ms']:.2f} / "
                             f"{e['overhead_ms']:.2f} | {_over_floor(e)} | {e.get('speedup_vs_w4a16', float('nan')):.2f}× | "
                             f"{e.get('model_speedup', float('nan')):.2f}× | {model_alpha} | {mem} |")
        lines.append("")
    return "\n".join(lines)


AR = tuple(m for m in METHODS if m != "qspec")  # the autoregressive methods


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,llama2-7b,llama2-13b")
    ap.add_argument("--batches", type=int_list(), default="1,8,16,32,64")
    ap.add_argument("--contexts", type=int_list(), default="512")
    ap.add_argument("--new", type=positive_int, default=512)
    ap.add_argument("--gammas", type=int_list(), default="1,3,5")
    ap.add_argument("--drafts", default="w4a8,w4a4")
    ap.add_argument("--ar", default="w16a16,w4a16,w4a8,w4a4", help=f"autoregressive methods, of {', '.join(AR)}")
    ap.add_argument("--kernels", default="auto", choices=KERNELS)
    ap.add_argument("--trace", type=Path, help="acceptance trace JSON (from --record-trace)")
    ap.add_argument("--record-trace", type=Path, help="record the trace on SmolLM2 into this file and exit")
    ap.add_argument("--gsm8k", type=Path, help="GSM8K-dev JSONL (for --record-trace and smollm2's prompts)")
    ap.add_argument("--gsm8k-train", type=Path, help="GSM8K-train JSONL (smollm2's few-shot prompt prefixes)")
    ap.add_argument("--prompts", type=positive_int, default=32)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    ap.add_argument("--resume", type=Path, default=None, help="an earlier decode.json: its configurations are kept")
    ap.add_argument("--label", default="", help="a note on the code measured (e.g. a commit), kept with each new section")
    ap.add_argument("--rerun", action="store_true",
                    help="with --resume: measure the configurations named here again, replacing the old ones")
    ap.add_argument("--budget-s", type=positive_seconds, default=float("inf"),
                    help="start no configuration estimated to end after this many seconds")
    ap.add_argument("--threads", type=positive_int, default=min(8, os.cpu_count() or 1), help="compiles at once")
    ap.add_argument("--reps", type=positive_int, default=1,
                    help="timed runs of each decode loop after its short warm-up (the best is kept)")
    ap.add_argument("--shard", type=parse_shard, default=None,
                    help="I/N: measure only share I of N of the configurations left to measure (one GPU's "
                         "share: bench.decode_gpus)")
    args = ap.parse_args(argv)
    args.drafts = [d for d in args.drafts.split(",") if d]
    for d in args.drafts:
        try:
            parse_draft(d)
        except ValueError as e:
            ap.error(str(e))
    args.ar = [m for m in args.ar.split(",") if m]
    if unknown_ar := [m for m in args.ar if m not in AR]:
        ap.error(f"--ar: unknown methods {unknown_ar}; expected some of {', '.join(AR)}")
    if args.record_trace:
        if not args.gsm8k:
            raise SystemExit("--record-trace needs --gsm8k")
        record_trace(args)
        return
    trace = read_json(args.trace, "--trace") if args.trace else {}
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS and n != REAL_MODEL]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join([*MODELS, REAL_MODEL])}")
    if REAL_MODEL in names and not (args.gsm8k and args.gsm8k_train):
        raise SystemExit(f"{REAL_MODEL} (real prompts) needs --gsm8k and --gsm8k-train")
    if args.drafts and not args.trace and any(n != REAL_MODEL for n in names):
        raise SystemExit("QSPEC on random weights needs --trace (make one with --record-trace)")
    for d in args.drafts if any(n != REAL_MODEL for n in names) else ():
        rounds = trace.get(d, {}) if isinstance(trace.get(d), dict) else {}
        missing = [g for g in args.gammas if str(g) not in rounds]
        if missing:
            raise SystemExit(f"the trace has no {d} rounds for gamma {missing}")
        for g in args.gammas:
            r = rounds[str(g)]
            if not (isinstance(r, list) and r and all(isinstance(x, list) and x and all(
                    isinstance(a, int) and 0 <= a <= g for a in x) for x in r)):
                raise SystemExit(f"the trace's {d} gamma-{g} entry must be a non-empty list of rounds, each a "
                                 f"non-empty list of accepted counts in [0, {g}]")
    for n in names:
        if n in MODELS and max(args.contexts) + args.new > MODELS[n].max_position_embeddings:
            raise SystemExit(f"{n}: context {max(args.contexts)} + {args.new} new tokens exceeds its "
                             f"{MODELS[n].max_position_embeddings} positions")
    old = read_json(args.resume, "--resume", {"command": str, "results": list}) if args.resume else None
    budget = Budget(time.perf_counter() + args.budget_s)
    bw, rates = copy_bandwidth(), matmul_rates()
    command = command_line("bench.decode", argv)
    run = {"command": command, "device": jax.devices()[0].device_kind, "copy_bw": bw, "matmul_rates": rates,
           "trace_source": trace.get("source", "-"), "results": []}
    if old is not None:
        run["results"] = [r for r in old["results"] if "skipped" not in r]
        run["command"] = f"{old['command']}; then {command}"
    contexts, batches = args.contexts, args.batches
    grid = {(n, c, b) for n in names for c in contexts for b in batches}
    done = set()
    for r in run["results"]:  # a disturbed section, or one that lacks what this run measures, is measured again
        if (why := "disturbed" if r.get("disturbed") else _lacks(r, args)) is None:
            done.add(_key(r))
        elif _key(r) in grid:
            log(f"{r['model']} B={r['batch']} ctx={r['context']}: measured again, the earlier section is {why}")
    if args.rerun:  # measured again; each old section stays until its new one replaces it (record)
        done -= grid
    if args.shard:  # the other shards' configurations count as done here
        wanted = [(n, c, b) for n in names for c in contexts for b in batches if (n, c, b) not in done]
        i, parts = args.shard
        done |= set(wanted) - set(split_by_cost(wanted, lambda t: config_cost_s(*t, args), parts)[i])
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s; dense matmul {rates['bf16'] / 1e12:.0f} TFLOP/s bf16, "
        f"{rates['int8'] / 1e12:.0f} TOP/s int8")
    for name in names:
        todo = [(c, b) for c in contexts for b in batches if (name, c, b) not in done]
        if todo:
            _bench_model(name, todo, args, trace, bw, rates, run, budget)
    save(run, args.out)
    print(markdown({**run, "results": [r for r in run["results"] if "skipped" not in r]}))


def _bench_model(name: str, todo: list[tuple[int, int]], args, trace: dict, bw: float, rates: dict[str, float],
                 run: dict, budget: Budget) -> None:
    """Every (context, batch) of ``todo`` for one model that ``budget`` lets start, each compiled and
    then timed (never both at once), appended to ``run`` and saved after each."""
    if not any(budget.fits(config_cost_s(name, context, batch, args)) for context, batch in todo):
        log(f"{name}: no configuration fits the {max(budget.left(), 0):.0f} s left of the budget, not loaded")
        return
    model = load(args.checkpoint or default_checkpoint()) if name == REAL_MODEL else None
    cfg = MODELS[name] if model is None else model.config
    params = random_params(cfg, jax.random.key(1)) if model is None else model.checkpoint.params
    fparams = float_params(params) if "w16a16" in args.ar else None
    for context, batch in todo:
        need = memory_need(weight_bytes(params), cfg, context, batch, args)
        if need > MEM_LIMIT:
            log(f"{name} B={batch} ctx={context}: skipped, needs ~{need / 1e9:.0f} GB")
            record(run, {"model": name, "batch": batch, "context": context, "new": args.new,
                         "skipped": f"needs ~{need / 1e9:.0f} GB"})
            continue
        estimate = config_cost_s(name, context, batch, args)
        if not budget.fits(estimate):
            log(f"{name} B={batch} ctx={context}: not started, ~{budget.pace() * estimate:.0f} s estimated, "
                f"{max(budget.left(), 0):.0f} s of the budget left")
            continue
        log(f"{name} B={batch} ctx={context}")
        t0 = time.perf_counter()
        c = plan_config(name, cfg, params, fparams, batch, context, args, trace if model is None else None, bw, model)
        compiled = compile_config(c, args.threads)
        waited = time.perf_counter() - t0
        log(f"  {len(compiled)} programs ready after {waited:.0f} s")
        t1 = time.perf_counter()
        try:
            res = run_config(c, compiled, params, fparams, args, rates)
        except jax.errors.JaxRuntimeError as e:  # one configuration out of memory: record it, go on
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            log(f"  out of GPU memory: {str(e).splitlines()[0][:200]}")
            res = {**c.res, "skipped": "out of GPU memory while timing"}
        reason = phase_check(res)
        if reason:
            log(f"  not a valid measurement: {reason}")
            res["disturbed"] = reason
        del compiled  # its executables and buffers, before the next configuration's states
        res["bench_s"] = {"compile_wait": waited, "timing": time.perf_counter() - t1}  # the benchmark's own cost
        budget.measured(estimate, time.perf_counter() - t0)
        record(run, {**res, "label": args.label} if args.label else res)
        save(run, args.out)


def _key(r: dict) -> tuple[str, int, int]:
    return r["model"], r["context"], r["batch"]


def _lacks(r: dict, args) -> str | None:
    """What the earlier section ``r`` lacks of this run's measurements (None: nothing), so that a
    ``--resume`` with other settings measures its configuration again instead of keeping it silently."""
    if r.get("new") != args.new:
        return f"of {r.get('new')} new tokens, not {args.new}"
    if r.get("kernels", KERNELS_MEASURED) != resolve_kernels(args.kernels):  # older sections: the Pallas kernels
        return f"of the {r['kernels']} kernels"
    want = {*args.ar, *(f"qspec {d} g={g}" for d in args.drafts for g in args.gammas)}
    if missing := sorted(want - set(r.get("methods", {}))):
        return f"without {', '.join(missing)}"
    return None


def record(run: dict, res: dict) -> None:
    """Add ``res`` to ``run``'s results: a measured section replaces an earlier one of the same (model,
    context, batch) in its place; a skipped one never replaces a measured one (a ``--rerun`` that
    could not run, for memory, keeps what was measured before), nor a disturbed one a valid one. A
    replacement of fewer methods is logged with the methods it drops."""
    at = [i for i, r in enumerate(run["results"]) if _key(r) == _key(res)]
    old = run["results"][at[0]] if at else None
    if old is None:
        run["results"].append(res)
    elif "skipped" in res or (res.get("disturbed") and "skipped" not in old and not old.get("disturbed")):
        log(f"  kept the earlier {res['model']} B={res['batch']} ctx={res['context']} section")
    else:
        dropped = sorted(set(old.get("methods", {})) - set(res.get("methods", {})))
        if dropped:  # a --rerun of fewer methods: say what the old section loses
            log(f"  replaced the earlier {res['model']} B={res['batch']} ctx={res['context']} section; "
                f"not measured again, so dropped: {', '.join(dropped)}")
        run["results"][at[0]] = res


def save(run: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(run, indent=1))
    (out / "decode.md").write_text(markdown({**run, "results": [r for r in run["results"] if "skipped" not in r]}))


if __name__ == "__main__":
    main()
