"""End-to-end decode throughput of QSPEC against autoregressive decoding, on Llama-shaped models with
random INT4 weights (and on SmolLM2's real weights and prompts).

    # the headline matrix (~16 min on one H100 / H200) in resumable parts of at most --budget-s seconds;
    # each part prints the configurations left and the --resume that continues:
    PYTHONPATH=. python3 -m bench.decode --preset headline --budget-s 540 --out $OUT
    PYTHONPATH=. python3 -m bench.decode --preset headline --budget-s 540 --resume PREV/decode.json --out $OUT
    # what a preset measures, what fits the card and how long it should take, without measuring:
    PYTHONPATH=. python3 -m bench.decode --preset headline --plan h100
    # any matrix (flags given explicitly override a preset's):
    PYTHONPATH=. python3 -m bench.decode --trace bench/results/acceptance_trace.json \
        [--models llama3-8b,llama2-7b,llama2-13b,llama2-70b,smollm2] [--batches 1,8,16,32,64]
        [--contexts 512,4096] [--new 512] [--gammas 1,3,5] [--auto] [--drafts w4a8,w4a4,w4a8/kv8]
        [--ar w16a16,w4a16,w4a8,w4a4] [--out DIR] [--resume OLD.json] [--rerun] [--budget-s 540]
        [--threads 8] [--reps 1] [--phase-reps 16] [--label TEXT]
        [--gsm8k DEV.jsonl --gsm8k-train TRAIN.jsonl [--checkpoint DIR] [--real-contexts 512]]
    # the acceptance trace replayed on random weights, recorded on SmolLM2 (plain chat questions, or
    # few-shot prompts filling each of --trace-contexts, one table per context):
    PYTHONPATH=. python3 -m bench.decode --record-trace bench/results/acceptance_trace.json \
        --gsm8k ../shared/data/gsm8k_test_dev.jsonl \
        [--trace-contexts 512,3584 --gsm8k-train ../shared/data/gsm8k_train.jsonl]

Presets: ``headline`` (Llama-2-7B, Llama-3-8B, Llama-2-13B x batch 1, 8, 16, 32 x context 512 and 4096,
W4A16 and W4A8 AR, QSPEC with ``generate``'s default draft (W4A8 over a window of 1024 + 64 sinks) at
gamma 1, 3 and "auto", acceptance replayed from few-shot prompts of 512 and 3584 tokens, plus SmolLM2 at context 512 when its
checkpoint and the GSM8K files are found: ``--gsm8k`` / ``--gsm8k-train``, else ``$QSPEC_JAX_DATA`` or
../shared/data) and ``full`` (every model, batch 1-64, gamma 1, 3, 5, drafts W4A8, W4A4 and
W4A8 over an INT8 KV shadow, the W16A16 baseline), both resumable.

Per (model, context P, batch B): a decode state of P committed tokens per sequence (random tokens, a
zeroed KV cache: decode time does not depend on the values), then each method generates ``--new``
tokens in its jitted ``while_loop``. A configuration's programs are all compiled first and nothing
compiles while anything is timed; each loop is timed on a fresh state after a short warm-up run.
Reported: tokens/s, ms per step (AR) or per round (QSPEC), the ratio to W4A16 AR of the same run, the
best fixed gamma, and gamma = ``generate``'s default marked "default"; gamma "auto" is timed alternately
with the W4A16 AR loop (``--reps`` times each) and compared with those runs. QSPEC's accept decisions are
**replayed** from a per-round trace recorded on SmolLM2 (every draft step and verify still runs; random
weights would accept nothing); ``smollm2`` (real few-shot GSM8K prompts, prefilled) uses its own. A trace
recorded per context is replayed from the recorded context nearest to the configuration's (the section
names it). A draft ``MODE[/kvBITS][/winSIZE[+SINKS]][/head[ROWS][q4]]`` reads an INT8 / INT4 shadow of the KV
cache, attends over the first SINKS (default 64) and the last SIZE positions only, and / or computes its logits
from a draft head: the lm_head's rows of the ROWS most frequent tokens (random weights: the first ROWS rows),
``q4`` an INT4 copy of them (or of the whole head).

QSPEC phases (a draft step, a verify of gamma + 1 tokens) are also timed alone: the speed-up model of
docs/design.md §2, ``S = E[L] * T_w4a16 / (gamma * T_draft + T_verify + T_overhead)``, stands beside the
measured speed-up, and each phase beside its floor (bytes over the copy bandwidth, or matmul FLOPs over
the dense matmul rate, both measured in the same run). Memory per method: the buffers its compiled loop
needs (XLA's buffer assignment). A configuration whose estimated memory exceeds the card's is skipped
and listed as such, and a draft whose KV shadow or head copy does not fit is left out of it (named); a section whose rounds come out shorter than their phases is marked ``disturbed``
and measured again by the next ``--resume``.

Writes ``decode.json`` / ``decode.md`` under ``--out`` (default ``$OUT``, else bench/results) after every
configuration; each section records the GPU, date (UTC), commit and command line. ``--resume OLD.json``
keeps its configurations (``--rerun``: measures the named ones again); ``--budget-s``: no configuration
starts that would not end in time (estimated from the cost model, calibrated on recorded sections).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# the benchmark owns the GPU: XLA's default 75% would leave the largest caches out of memory
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.args import (command_line, git_commit, int_list, positive_int, positive_seconds, read_gsm8k,  # noqa: E402
                        read_json, utc_now)
from bench.hooks import acceptance_trace, replay_auto_loop, replay_loop, unstack_layers  # noqa: E402
from bench.report import vs_w4a16  # noqa: E402
from bench.shapes import MODELS  # noqa: E402
from convert.embedded import default_checkpoint  # noqa: E402
from pallas_kernels.layout import QuantizedWeight, dequantize  # noqa: E402
from pallas_kernels.precision import W4A16, parse_precision  # noqa: E402
from pallas_kernels.reference import KV_BITS, AttentionWindow  # noqa: E402
from qspec_jax.api import (DEFAULT_DRAFT, DEFAULT_GAMMA, DEFAULT_SINKS, DEFAULT_WINDOW, DRAFTS, METHODS,  # noqa: E402
                           load)
from qspec_jax.config import LlamaConfig  # noqa: E402
from qspec_jax.gamma import MIN_GAIN, cost_model, drafting_can_pay, expected_tokens  # noqa: E402
from qspec_jax.kernels import KERNELS, Execution, resolve_kernels  # noqa: E402
from qspec_jax.core import AUTO_GAMMA_MAX, Decoder, decode, init_state, prefill_jit  # noqa: E402
from qspec_jax.decode import DecodeState, Runtime  # noqa: E402
from qspec_jax.model import DRAFT_HEAD_GROUP, init_cache, sync_shadow, with_draft_head  # noqa: E402

GROUP = 128  # random weights: symmetric, group 128
REAL_MODEL = "smollm2"  # the embedded model (or --checkpoint) with real prompts and real acceptance
DEFAULT_TRACE = Path("bench/results/acceptance_trace.json")
CONTEXT_TRACE = Path("bench/results/acceptance_contexts.json")  # few-shot prompts filling 512 and 3584 tokens
DEFAULT_DRAFT_VIEW = f"{DEFAULT_DRAFT}/win{DEFAULT_WINDOW}+{DEFAULT_SINKS}"  # generate()'s default draft
# a configuration runs only if its estimated bytes (memory_need) fit this share of the card's memory:
# the estimate leaves out XLA's temporaries and the allocator's fragmentation
MEM_HEADROOM = 0.87
MEM_LIMIT: float | None = None  # bytes; None: the device's (memory_limit)
FORWARD_REPS = 16  # forwards per timed phase loop (--phase-reps)
WARM_TOKENS = 4  # tokens per sequence a decode loop's warm-up run generates
# the cost model (config_cost_s), fitted to recorded sections: seconds per program compiled (8 threads),
# and per generated token a multiple of the W4A16 step's bytes floor plus a fixed part (launches, phases)
COMPILE_S = 1.5
STEP_FLOOR_FACTOR = 2.0
STEP_S = 4.7e-3
# measured / estimated seconds assumed before any section calibrates it (calibrated_pace)
PACE = 1.5
# a round (one loop iteration) cannot be shorter than its gamma draft steps and its verify, each timed
# alone: more than this share shorter means the phases were slowed while they were timed
PHASE_SLACK = 0.05
# assumed by --plan for a card this process does not run on: copy bandwidth (bytes/s) and XLA's memory
# limit at a 0.95 memory fraction (bytes)
CARDS = {"h100": (3.0e12, 81.2e9), "h200": (4.3e12, 143.0e9)}


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


def lm_head_bytes(params: dict) -> int:
    """Bytes of the lm_head (the embedding table where it is tied)."""
    return int((params["lm_head"] if "lm_head" in params else params["embed"]).nbytes)


def draft_head_bytes(params: dict) -> int:
    """Bytes of the draft head's weights (a float copy, or an INT4 copy's codes, scales and minimums)."""
    return int(sum(a.nbytes for a in jax.tree.leaves(params["draft_head"]["w"])))


def weight_bytes(params: dict) -> int:
    """Bytes one step reads: every weight but the embedding table (unless it is tied, read as the lm_head)."""
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    return int(total - params["embed"].nbytes if "lm_head" in params else total)


def matmul_flops_per_token(cfg: LlamaConfig, head_rows: int | None = None) -> int:
    """2 x the weights every token multiplies (qkv, o, gate/up, down per layer, and ``head_rows`` rows of
    the lm_head: None, all of them)."""
    qkv = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    o = cfg.num_heads * cfg.head_dim * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    rows = cfg.vocab_size if head_rows is None else head_rows
    return 2 * (cfg.num_layers * (qkv + o + mlp) + rows * cfg.hidden_size)


def kv_bytes(cfg: LlamaConfig, batch: int, slots: int) -> int:
    return 2 * cfg.num_layers * batch * slots * cfg.num_kv_heads * cfg.head_dim * 2


def _programs(args) -> tuple[int, int]:
    """(decode loops, programs compiled) of one configuration: every loop, plus the phase forwards (the
    W4A16 step, and per draft its step and a verify per gamma)."""
    loops = len(args.ar) + len(args.drafts) * (len(args.gammas) + args.auto)
    phases = (1 + len(args.drafts) * (1 + len(args.gammas))) if args.drafts else 0
    return loops, loops + phases


def config_cost_s(name: str, context: int, batch: int, args, bw: float = CARDS["h200"][0],
                  limit: float | None = None) -> float:
    """One configuration's seconds, estimated: its compiles, then every decode loop's tokens at
    :data:`STEP_FLOOR_FACTOR` x the W4A16 step's bytes floor (packed weights + the KV read at the mid
    context, over ``bw``) plus :data:`STEP_S`; 0 for one too large for ``limit`` (it is skipped).
    Scaled by the pace (:func:`calibrated_pace`, :class:`Budget`)."""
    if name == REAL_MODEL:  # a 135M model: its steps are launch-bound
        loops, programs = _programs(args)
        return COMPILE_S * programs + loops * args.new * STEP_S
    cfg = MODELS[name]
    packed = matmul_flops_per_token(cfg) / 4  # ~ the INT4 weights' bytes (half a byte per weight)
    limit = memory_limit() if limit is None else limit
    w16a16 = runs_w16a16(packed, cfg, args, limit)
    args = fitting(args, packed, cfg, context, batch, w16a16, limit)[0]
    if args is None:
        return 0.0
    loops, programs = _programs(args)
    loops -= "w16a16" in args.ar and not w16a16
    step = STEP_FLOOR_FACTOR * (packed + kv_bytes(cfg, batch, context + args.new // 2)) / bw + STEP_S
    return COMPILE_S * programs + loops * args.new * step


def memory_limit() -> float:
    """Bytes a configuration may need (:func:`memory_need`): :data:`MEM_HEADROOM` of what XLA may
    allocate on the device (its ``bytes_limit``), :data:`MEM_LIMIT` where set; no limit without either."""
    if MEM_LIMIT is not None:
        return MEM_LIMIT
    stats = jax.devices()[0].memory_stats() or {}
    return MEM_HEADROOM * stats["bytes_limit"] if stats.get("bytes_limit") else float("inf")


def runs_w16a16(weight_bytes: float, cfg: LlamaConfig, args, limit: float) -> bool:
    """Whether a model runs the W16A16 baseline: asked for, and its bf16 copy fits beside the smallest
    configuration (its bf16 weights stay in memory for all of the model's configurations)."""
    return "w16a16" in args.ar and memory_need(weight_bytes, cfg, min(args.contexts), min(args.batches), args,
                                                True) <= limit


def memory_need(weight_bytes: float, cfg: LlamaConfig, context: int, batch: int, args,
                w16a16: bool | None = None) -> float:
    """Device bytes one configuration needs, estimated: the weights (five times with the W16A16
    baseline's bf16 copy, 2 bytes per weight against ~0.5), the KV cache (each loop donates its state:
    XLA's buffer assignment holds one), the largest draft shadow and the largest draft head copy. A
    method that still runs out of memory is recorded as such (:func:`run_config`)."""
    kv = kv_bytes(cfg, batch, context + args.new + 64)
    shadow = max([parse_draft(d).kv or 0 for d in args.drafts] + [0]) / 16  # a shadow's bytes per cache byte
    if w16a16 is None:
        w16a16 = "w16a16" in args.ar
    heads = max([parse_draft(d).head_copy_bytes(cfg) for d in args.drafts] + [0.0])
    return weight_bytes * (5 if w16a16 else 1) + kv + (kv * (shadow + 1 / 32) if shadow else 0) + heads


def qspec_methods(draft: str, args) -> list[str]:
    """The names of ``draft``'s QSPEC loops a run measures: one per fixed gamma, and ``g=auto`` with ``--auto``."""
    return [f"qspec {draft} g={g}" for g in [*args.gammas, *(["auto"] if args.auto else [])]]


def fitting(args, weight_bytes: float, cfg: LlamaConfig, context: int, batch: int, w16a16: bool,
            limit: float) -> tuple[argparse.Namespace | None, dict[str, str]]:
    """``args`` without the drafts whose own memory (a shadow, a head copy) does not fit ``limit`` beside
    the autoregressive methods, and ``{method: why}`` for each QSPEC loop so left out; (None, {}) where
    the autoregressive methods alone do not fit."""
    need = lambda drafts: memory_need(weight_bytes, cfg, context, batch,  # noqa: E731
                                      argparse.Namespace(**{**vars(args), "drafts": drafts}), w16a16)
    if need([]) > limit:
        return None, {}
    kept = [d for d in args.drafts if need([d]) <= limit]
    left_out = {m: f"its draft needs ~{need([d]) / 1e9:.0f} GB, more than the {limit / 1e9:.0f} GB"
                for d in args.drafts if d not in kept for m in qspec_methods(d, args)}
    return argparse.Namespace(**{**vars(args), "drafts": kept}), left_out


def _section_args(r: dict) -> argparse.Namespace:
    """The method set a recorded section measured, as :func:`config_cost_s` reads it."""
    qspec = [m.split() for m in r.get("methods", {}) if m.startswith("qspec ")]
    return argparse.Namespace(ar=[m for m in r.get("methods", {}) if not m.startswith("qspec ")],
                              drafts=sorted({q[1] for q in qspec}),
                              gammas=sorted({q[2] for q in qspec if q[2] != "g=auto"}),
                              auto=any(q[2] == "g=auto" for q in qspec),
                              new=r.get("new", 512), contexts=[r["context"]], batches=[r["batch"]])


def calibrated_pace(sections: list[dict]) -> tuple[float, float] | None:
    """(median, largest) of recorded seconds / :func:`config_cost_s` over ``sections`` that record
    their time (``bench_s``) and copy bandwidth; None without any."""
    ratios = []
    for r in sections:
        if "bench_s" not in r or "methods" not in r or not r.get("copy_bw") or (
                r["model"] not in MODELS and r["model"] != REAL_MODEL):
            continue
        est = config_cost_s(r["model"], r["context"], r["batch"], _section_args(r), r["copy_bw"], float("inf"))
        if est > 0:
            ratios.append((r["bench_s"]["compile_wait"] + r["bench_s"]["timing"]) / est)
    return (float(np.median(ratios)), max(ratios)) if ratios else None


DRAFT_GRAMMAR = "MODE[/kvBITS][/winSIZE[+SINKS]][/head[ROWS][q4]]"


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """A ``--drafts`` entry: the draft's precision, the KV shadow it reads (bits, None: the cache) and
    its attention window (None: the whole context)."""

    mode: str
    kv: int | None = None
    window: AttentionWindow | None = None
    head_rows: int | None = None  # a draft head of the ranking's first rows (None: every token)
    head_bits: int = 16  # 4: the drafts' head is an INT4 copy

    @property
    def head(self) -> bool:
        """Whether the drafts read a copy of the lm_head (``generate``'s ``draft_head`` / ``draft_head_bits``)."""
        return self.head_rows is not None or self.head_bits != 16

    def runtime(self, rt: Runtime) -> Runtime:
        """``rt`` with this draft's views of the cache and its head."""
        return dataclasses.replace(rt, draft_kv=self.kv, draft_window=self.window, draft_head=self.head)

    def with_head(self, params: dict, cfg: LlamaConfig) -> dict:
        """Random weights' ``params`` with this draft's head over the first rows in id order (which rows does not
        change the bytes a draft step reads), or as they are without one."""
        return with_draft_head(params, cfg, None, self.head_rows, self.head_bits) if self.head else params

    def head_copy_bytes(self, cfg: LlamaConfig) -> float:
        """Device bytes of this draft's head copy, estimated (an INT4 copy: half a byte per weight plus its
        float32 scales and minimums per group); 0 without one."""
        if not self.head:
            return 0.0
        per_weight = 2 if self.head_bits == 16 else 0.5 + 8 / DRAFT_HEAD_GROUP
        return (self.head_rows or cfg.vocab_size) * cfg.hidden_size * per_weight


def parse_draft(spec: str, modes: tuple[str, ...] = DRAFTS) -> DraftSpec:
    """A ``--drafts`` entry, ``MODE[/kvBITS][/winSIZE[+SINKS]][/head[ROWS][q4]]``: ``/kvBITS`` reads an
    INT8 / INT4 KV shadow, ``/winSIZE+SINKS`` attends over the first SINKS (default DEFAULT_SINKS) and
    the last SIZE slots only, ``/headROWS`` computes logits over the ROWS most frequent tokens only and
    ``q4`` from an INT4 copy of the head; ``modes``: the modes allowed."""
    kv_bits = "|".join(map(str, KV_BITS))
    m = re.fullmatch(rf"([^/]+)(?:/kv({kv_bits}))?(?:/win([1-9][0-9]*)(?:\+([0-9]+))?)?"
                     r"(?:/head(?:([1-9][0-9]*)(q4)?|(q4)))?", spec)
    if m is None or m[1] not in modes:
        raise ValueError(f"unknown draft {spec!r}: expected {DRAFT_GRAMMAR} with MODE one of {', '.join(modes)}, "
                         f"BITS {' or '.join(map(str, KV_BITS))}, SIZE >= 1 and SINKS >= 0 "
                         f"(default {DEFAULT_SINKS}), ROWS >= 1 and/or q4, e.g. w4a8, w4a8/kv8, w4a8/win1024, "
                         "w4a8/kv8/win512+4, w4a8/head8192, w4a8/headq4")
    window = None if m[3] is None else AttentionWindow(DEFAULT_SINKS if m[4] is None else int(m[4]), int(m[3]))
    return DraftSpec(m[1], None if m[2] is None else int(m[2]), window, None if m[5] is None else int(m[5]),
                     4 if m[6] or m[7] else 16)


def fresh_state(cfg: LlamaConfig, batch: int, context: int, new: int, gamma: int, seed: int,
                shadow_bits: int | None = None) -> DecodeState:
    """``context`` committed tokens per sequence (random), a zeroed bf16 KV cache (and its
    ``shadow_bits`` shadow) sized for ``new`` more tokens plus a QSPEC round."""
    key = jax.random.key(seed)
    rt = Runtime(cfg, dtype=jnp.bfloat16, draft_kv=shadow_bits)
    prompts = jax.random.randint(key, (batch, context), 0, cfg.vocab_size, jnp.int32)
    return init_state(Decoder(rt, W4A16), prompts, jnp.full((batch,), context), key, max_new_tokens=new,
                      buffer_len=context + new + gamma + 1)


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
    dec = Decoder(rt, W4A16)
    buf = int(lengths.max()) + new + gamma + 1
    return lambda: prefill_jit(model.checkpoint.params, dec, init_state(
        dec, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), max_new_tokens=new, buffer_len=buf))


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


def forward_loop(rt: Runtime, mode: str, reps: int, draft: bool = False):
    """A jitted ``f(params, carry) -> carry`` running ``reps`` decode-time forwards in one
    ``fori_loop`` (no host dispatch between them, as inside the decode loops; the argmax feeds the
    next forward, so the lm_head is not dead code); ``carry`` is :func:`forward_carry`'s; ``draft``: over
    the draft's views of the cache (:meth:`Runtime.run`)."""

    def many(p, carry):
        def one(i, carry):
            toks, pos, c = carry
            logits, c = rt.run(p, toks, pos, c, parse_precision(mode), draft=draft)
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


def best_seconds(call: Callable[[Any], Any], repeats: int = 5, fresh: Callable[[], Any] = lambda: None) -> float:
    """The fastest of ``repeats`` wall-clock timings of ``call(fresh())`` after one warm-up call (a single
    sample can be slowed by the host); each input from ``fresh`` is made, and ready, before its timer starts."""
    jax.block_until_ready(call(fresh()))
    best = float("inf")
    for _ in range(repeats):
        x = jax.block_until_ready(fresh())
        t = time.perf_counter()
        jax.block_until_ready(call(x))
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

    return 10 * 8 * a.size / best_seconds(lambda _: ten_calls())


def matmul_rates() -> dict[str, float]:
    """Dense matmul rate (FLOP/s) of XLA's bf16 dot and its int8 -> int32 dot on square operands
    (8192 on a GPU, 256 elsewhere), best of 5: the compute roof of the phase floors."""
    n = 8192 if jax.default_backend() == "gpu" else 256
    rates = {}
    for name, dtype, acc in (("bf16", jnp.bfloat16, jnp.float32), ("int8", jnp.int8, jnp.int32)):
        a = jnp.ones((n, n), dtype)
        f = jax.jit(lambda x, y, acc=acc: jnp.dot(x, y, preferred_element_type=acc))
        rates[name] = 2 * n**3 / best_seconds(lambda _: f(a, a))
    return rates


def loop_memory_bytes(compiled) -> int:
    """Device bytes a compiled program needs: its arguments, outputs (less those aliasing a donated
    argument) and temporaries, from XLA's buffer assignment."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


# ------------------------------------------------------------------------------ one configuration

KERNELS_MEASURED = "pallas"  # what a section that does not record its kernels ran on
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
    draft_params: dict  # draft spec -> the params its loop and draft steps read (a draft head added)


def plan_config(name: str, cfg: LlamaConfig, params: dict, fparams: dict | None, batch: int, context: int,
                args, trace: dict | None, bw: float, model=None, draft_params: dict | None = None) -> Config:
    """Every method's program at one (model, context, batch), not yet compiled. ``model`` (real
    weights): states prefilled from real prompts and QSPEC's own accept decisions (``trace`` None);
    otherwise random states and the trace's accept decisions replayed. ``draft_params``: a draft's own
    params where it reads a draft head."""
    draft_params = {d: (draft_params or {}).get(d, params) for d in args.drafts}
    res: dict = {"model": name, "batch": batch, "context": context, "new": args.new, "methods": {},
                 "acceptance": "replayed" if model is None else "measured", "kernels": resolve_kernels(args.kernels)}
    gmax = max([*args.gammas, *([AUTO_GAMMA_MAX] if args.auto else [])])
    rt = Runtime(cfg, dtype=jnp.bfloat16, online_rotation_seed=None if model is None else
                 model.checkpoint.online_rotation_seed, execution=Execution.decode(args.kernels))
    if model is not None:
        prompts = fewshot_prompts(model, args.gsm8k, args.gsm8k_train, batch, context)
        res["prompt_tokens"] = float(np.mean([len(p) for p in prompts]))

    def maker(bits: int | None):
        if model is None:
            return lambda: fresh_state(cfg, batch, context, args.new, gmax, 0, bits)
        return real_state_maker(model, dataclasses.replace(rt, draft_kv=bits), prompts, args.new, gmax)

    makes = {bits: maker(bits) for bits in {None, *(parse_draft(d).kv for d in args.drafts)}}
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
        jobs["ar", method] = (jax.jit(lambda q, s, d=Decoder(rt_m, parse_precision(method)): decode(q, d, s),
                                      donate_argnums=1), (p, state))
    if args.drafts and ("ar", "w4a16") in jobs:
        jobs["fwd", "w4a16", 1, None, None] = (forward_loop(rt, "w4a16", args.phase_reps), (params, carry(1)))
    if trace is not None:
        at, rows = trace_rows(trace, context)
        if at is not None:
            res["trace_context"] = at
    for draft in args.drafts:
        spec = parse_draft(draft)
        mode, bits = spec.mode, spec.kv
        rt_d, state_d, p_d = spec.runtime(rt), jax.eval_shape(makes[bits]), draft_params[draft]
        jobs["draft", draft] = (forward_loop(rt_d, mode, args.phase_reps, draft=True), (p_d, carry(1, bits)))
        for g in args.gammas:
            replay = None if trace is None else jnp.asarray(draft_rounds(rows, draft)[str(g)], jnp.int32)
            jobs["qspec", draft, g] = (jax.jit(lambda q, s, g=g, p=parse_precision(mode), rt_d=rt_d, replay=replay: (
                decode(q, Decoder(rt_d, None, p, g), s) if replay is None
                else replay_loop(q, s, replay, rt=rt_d, gamma=g, draft=p)), donate_argnums=1), (p_d, state_d))
            # the verify on the draft's state: with a shadow, its re-quantization (sync_shadow) included
            jobs["fwd", "w4a16", g + 1, bits, None] = (forward_loop(rt_d, "w4a16", args.phase_reps),
                                                        (params, carry(g + 1, bits)))
        if args.auto:
            costs = cost_model(p_d, cfg, jnp.bfloat16, bits, spec.window)
            res.setdefault("auto_best_gain", {})[draft] = costs.best_gain(AUTO_GAMMA_MAX, batch, state.tokens.shape[1])
            replay = None if trace is None else jnp.asarray(auto_rounds(draft_rounds(rows, draft)), jnp.int32)
            jobs["qspec", draft, "auto"] = (jax.jit(lambda q, s, p=parse_precision(mode), rt_d=rt_d, replay=replay,
                                                    costs=costs: (
                decode(q, Decoder(rt_d, None, p, None, costs), s) if replay is None
                else replay_auto_loop(q, s, replay, rt=rt_d, gamma_max=AUTO_GAMMA_MAX, draft=p, costs=costs)),
                donate_argnums=1), (p_d, state_d))
    return Config(res, rt, makes, jobs, ahead, draft_params)


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
    prior: float = PACE  # the ratio assumed before the first (main: calibrated on recorded sections)

    def pace(self) -> float:
        """The slowest measured / estimated ratio so far, :attr:`prior` before the first."""
        return self.prior if self.slowest is None else self.slowest

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


OUT_OF_MEMORY = "out of GPU memory while timing"


@contextlib.contextmanager
def memory_recorded(res: dict, methods: list[str]):
    """Runs the block; where it runs out of GPU memory, the ``methods`` it had not measured yet are named
    in ``res["not_run"]`` instead (any other error is raised)."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):  # XLA's allocation failure; anything else is a bug
            raise
        missing = [m for m in methods if m not in res["methods"]]
        log(f"  {', '.join(missing)}: out of GPU memory: {str(e).splitlines()[0][:160]}")
        res.setdefault("not_run", {}).update({m: OUT_OF_MEMORY for m in missing})


def run_config(c: Config, compiled: dict, params: dict, fparams: dict | None, args, rates: dict[str, float]) -> dict:
    """Times ``c``'s compiled programs one by one: each method's decode loop, QSPEC's phases. A method
    whose buffers do not fit at run time is named in ``res["not_run"]`` and the others still run."""
    res, make, batch, ahead = c.res, c.makes[None], c.res["batch"], c.ahead
    floor_ms = res["floor_ms_per_step"]

    def phase_floor_ms(tokens: int, mma: str, kv_bits: int | None = None, window: AttentionWindow | None = None,
                       weights: float | None = None, head_rows: int | None = None) -> float:
        """The larger of the byte floor (``weights`` bytes, default the model's; the KV read from a
        ``kv_bits`` shadow: codes and a float32 scale per key / value vector; only a ``window``'s slots)
        and ``tokens`` tokens' matmul FLOPs (over ``head_rows`` lm_head rows: None, all) at the measured rate."""
        kv = res["kv_read_bytes"] * (1 if kv_bits is None else kv_bits / 16 + 2 / c.rt.config.head_dim)
        if window is not None:
            kv *= min(1.0, (window.sinks + window.size) / res["phase_context"])
        weights = res["weight_bytes"] if weights is None else weights
        flops = matmul_flops_per_token(c.rt.config, head_rows)
        return max(1e3 * (weights + kv) / res["copy_bw"], 1e3 * tokens * flops / rates[mma])

    def forward_ms(key: tuple, tokens: int, bits: int | None = None, p: dict | None = None) -> float:
        carry = forward_carry(c.makes[bits](), tokens, ahead)
        return time_forward(compiled[key], params if p is None else p, carry, args.phase_reps)

    for method in _ar_methods(args, fparams):
        # [0]: the loop's final state is dropped at once (held in a variable, a 70 GB cache would
        # still be alive when the next method makes its state: out of memory at 7B, batch 32, 3584)
        with memory_recorded(res, [method]):
            secs = time_loop(compiled["ar", method], fparams if method == "w16a16" else params, make, args.new,
                             args.reps)[0]
            res["methods"][method] = {"tokens_per_s": batch * args.new / secs, "ms_per_step": 1e3 * secs / args.new,
                                      "memory_bytes": loop_memory_bytes(compiled["ar", method])}
            log(f"  {method}: {res['methods'][method]['ms_per_step']:.2f} ms/step, "
                f"{res['methods'][method]['tokens_per_s']:.0f} tok/s (floor {floor_ms:.2f} ms/step)")
    base = res["methods"].get("w4a16", {}).get("ms_per_step")
    target_key = ("fwd", "w4a16", 1, None, None)
    t_target = None
    with memory_recorded(res, ["w4a16 phase forward"]):
        t_target = forward_ms(target_key, 1) if target_key in compiled else None
    for draft in args.drafts:
        with memory_recorded(res, qspec_methods(draft, args)):
            _run_draft(c, compiled, params, draft, args, res, base, t_target, forward_ms, phase_floor_ms)
    return res


def _run_draft(c: Config, compiled: dict, params: dict, draft: str, args, res: dict, base: float | None,
               t_target: float | None, forward_ms: Callable, phase_floor_ms: Callable) -> None:
    """:func:`run_config`'s QSPEC loops and phases of one draft (``params``: the target's), each loop's
    entry added to ``res["methods"]`` as soon as it is timed."""
    batch = res["batch"]
    spec = parse_draft(draft)
    mode, bits, p_d = spec.mode, spec.kv, c.draft_params[draft]
    t_draft = forward_ms(("draft", draft), 1, bits, p_d)
    # a draft head: its bytes read instead of the lm_head's
    draft_weights = res["weight_bytes"] + (draft_head_bytes(p_d) - lm_head_bytes(params) if spec.head else 0)
    for g in args.gammas:
        secs, out = time_loop(compiled["qspec", draft, g], p_d, c.makes[bits], args.new, args.reps)
        # a sequence counts the rounds it ran in; the loop runs until its slowest sequence is done
        rounds = np.asarray(out.rounds)
        alpha = int(np.asarray(out.accepted).sum()) / max(int(np.asarray(out.drafted).sum()), 1)
        del out  # its cache: the forward timings below make states of their own
        iterations, tail = int(rounds.max()), float(rounds.max() / rounds.mean())
        t_round = 1e3 * secs / iterations
        t_verify = forward_ms(("fwd", "w4a16", g + 1, bits, None), g + 1, bits)
        overhead = t_round - g * t_draft - t_verify
        tpr = args.new / float(rounds.mean())
        entry = {"tokens_per_s": batch * args.new / secs, "ms_per_round": t_round, "tokens_per_round": tpr,
                 "iterations": iterations, "tail": tail, "alpha": alpha,
                 "draft_ms": t_draft, "verify_ms": t_verify, "overhead_ms": overhead,
                 "draft_floor_ms": phase_floor_ms(batch, "int8", bits, spec.window, draft_weights, spec.head_rows),
                 "verify_floor_ms": phase_floor_ms(batch * (g + 1), "bf16"),
                 "memory_bytes": loop_memory_bytes(compiled["qspec", draft, g])}
        if base and t_target:
            entry["speedup_vs_w4a16"] = base * args.new / (1e3 * secs)
            # docs/design.md §2: E[L] * T_target / (gamma * T_draft + T_verify + T_overhead), that sum being t_round
            entry["model_speedup"] = tpr * t_target / t_round
            entry["model_speedup_alpha"] = float(expected_tokens(alpha, g)) * t_target / t_round
        res["methods"][f"qspec {draft} g={g}"] = entry
        log(f"  qspec {draft} g={g}: {t_round:.2f} ms/round ({g} x {t_draft:.2f} draft + {t_verify:.2f} verify + "
            f"{overhead:.2f}), {tpr:.2f} tok/round, batch tail x{tail:.2f}, {entry['tokens_per_s']:.0f} tok/s, "
            f"x{entry.get('speedup_vs_w4a16', float('nan')):.2f} vs w4a16 ({res['acceptance']} acceptance)")
    if args.auto:
        ar = (compiled["ar", "w4a16"], params, c.makes[None]) if ("ar", "w4a16") in compiled else None
        res["methods"][f"qspec {draft} g=auto"] = entry = _time_auto(compiled["qspec", draft, "auto"], p_d,
                                                                      c.makes[bits], args, ar)
        log(f"  qspec {draft} g=auto: mean gamma {entry['mean_gamma']:.2f}, {entry['tokens_per_round']:.2f} "
            f"tok/round, {entry['tokens_per_s']:.0f} tok/s, "
            f"x{entry.get('speedup_vs_w4a16', float('nan')):.2f} vs w4a16 ({res['acceptance']} acceptance)")


def _time_auto(loop, params: dict, make, args, ar: tuple | None) -> dict:
    """``gamma="auto"``'s decode loop timed whole: tokens/s, tokens per round (a W4A16 step counts as a
    round of γ = 0), the mean γ chosen, the acceptance, and, with ``ar = (compiled W4A16 AR loop, its params,
    its state maker)``, the speed-up over that loop timed alternately with it (each best of ``--reps``), so
    that a drift of the GPU's speed over the configuration's runs falls on both alike."""
    secs = ar_secs = float("inf")
    for _ in range(args.reps):
        out = None  # the previous run's state is freed before the next one is made
        if ar is not None:
            ar_secs = min(ar_secs, time_loop(*ar, args.new)[0])
        t, out = time_loop(loop, params, make, args.new)
        secs = min(secs, t)
    rounds, drafted = np.asarray(out.rounds), int(np.asarray(out.drafted).sum())
    alpha = int(np.asarray(out.accepted).sum()) / max(drafted, 1)
    memory = loop_memory_bytes(loop)
    del out
    # rounds: the loop iterations each sequence ran in, its W4A16 steps (gamma 0) included
    entry = {"tokens_per_s": len(rounds) * args.new / secs, "mean_gamma": drafted / max(int(rounds.sum()), 1),
             "tokens_per_round": args.new / max(float(rounds.mean()), 1e-9), "alpha": alpha, "memory_bytes": memory}
    if ar is not None:
        entry["w4a16_tokens_per_s_beside"] = len(rounds) * args.new / ar_secs
        entry["speedup_vs_w4a16"] = ar_secs / secs
    return entry


def auto_rounds(rounds: dict) -> list:
    """The rounds ``gamma="auto"`` replays: those recorded at the smallest gamma >= its largest
    (:data:`AUTO_GAMMA_MAX`), each clipped to the round's own gamma when replayed."""
    deep = sorted(int(g) for g in rounds if int(g) >= AUTO_GAMMA_MAX)
    if not deep:
        raise ValueError(f"gamma='auto' replays rounds recorded at gamma >= {AUTO_GAMMA_MAX}; "
                         f"the trace has gamma {sorted(int(g) for g in rounds)}")
    return rounds[str(deep[0])]


# ------------------------------------------------------------------------------ the trace

def record_trace(args, command: str) -> None:
    """Per-round accepted drafts of greedy QSPEC on SmolLM2: on GSM8K-dev questions in the chat
    template, or with ``--trace-contexts`` on few-shot prompts filling each context (one table each).
    The file (and its markdown summary beside it) is rewritten after every draft and gamma."""
    from qspec_jax.api import tokenize

    model = load(args.checkpoint or default_checkpoint())
    prompts = (f"few-shot GSM8K prompts (dev questions after train examples) of at most "
               f"{', '.join(map(str, args.trace_contexts))} tokens" if args.trace_contexts
               else "GSM8K-dev prompts")
    which = "embedded, default checkpoint" if args.checkpoint is None else f"checkpoint {args.checkpoint.name}"
    if model.checkpoint.draft_vocab is not None:
        which += ", draft heads' rows ranked by calibration frequency"
    out: dict = {"source": f"SmolLM2-135M-Instruct ({which}), greedy, chat template, "
                           f"{args.prompts} {prompts} x {args.new} new tokens",
                 "device": jax.devices()[0].device_kind, "dtype": "float32", "kernels": resolve_kernels(args.kernels),
                 "date": utc_now(), "commit": git_commit(), "command": command}
    args.record_trace.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.record_trace.write_text(json.dumps(out))
        args.record_trace.with_suffix(".md").write_text(trace_markdown(out))

    if not args.trace_contexts:
        ids = tokenize(model, [r["question"] for r in read_gsm8k(args.gsm8k, answers=False)[: args.prompts]], chat=True)
        _record_drafts(model, ids, args, out, save)
        return
    out["contexts"] = {}
    for context in args.trace_contexts:
        ids = fewshot_prompts(model, args.gsm8k, args.gsm8k_train, args.prompts, context)
        table = out["contexts"][str(context)] = {"prompt_tokens": float(np.mean([len(p) for p in ids]))}
        log(f"context {context}: {len(ids)} prompts of {table['prompt_tokens']:.0f} tokens on average")
        _record_drafts(model, ids, args, table, save, f"ctx={context} ")


def _record_drafts(model, ids: list[list[int]], args, table: dict, save: Callable[[], None], tag: str = "") -> None:
    """Fills ``table[draft][str(gamma)]`` with the rounds of every ``--drafts`` x ``--gammas`` on the
    prompts ``ids``, prefilled once (W4A16, float32); a shadow is quantized from that prefill."""
    cfg = model.config
    rt = Runtime(cfg, dtype=jnp.float32, online_rotation_seed=model.checkpoint.online_rotation_seed,
                 execution=Execution.decode(args.kernels))
    prefilled = real_state_maker(model, rt, ids, args.new, max(args.gammas))()
    states = {None: prefilled}
    for draft in args.drafts:
        spec = parse_draft(draft)
        if spec.kv not in states:
            states[spec.kv] = with_shadow(prefilled, cfg, spec.kv, max(len(p) for p in ids))
        table[draft] = {}
        for g in args.gammas:
            t = time.perf_counter()
            params = _checkpoint_head_params(model, spec)
            tr = acceptance_trace(params, states[spec.kv], rt=spec.runtime(rt), gamma=g,
                                  draft=parse_precision(spec.mode))
            # each sequence's own rounds, cut to the shortest: no row of a finished sequence is replayed
            cols = [c[c >= 0] for c in tr.T]
            rounds = min(len(c) for c in cols)
            tr = np.stack([c[:rounds] for c in cols], axis=1)
            table[draft][str(g)] = tr.tolist()
            save()
            log(f"{tag}{draft} gamma={g}: {rounds} rounds kept, mean accepted {tr.mean():.2f} "
                f"({1 + tr.mean():.2f} tokens per round), {time.perf_counter() - t:.0f} s")


def _checkpoint_head_params(model, spec: DraftSpec) -> dict:
    """A real checkpoint's params with ``spec``'s draft head (its token ranking's rows), or as they are."""
    if spec.head_rows is not None and model.checkpoint.draft_vocab is None:
        raise SystemExit(f"draft {spec.mode}/head{spec.head_rows}: the checkpoint has no token ranking (convert it "
                         "with --draft-vocab)")
    return model.decode_params((spec.head_rows, spec.head_bits) if spec.head else None)


def with_shadow(state: DecodeState, cfg: LlamaConfig, bits: int, width: int) -> DecodeState:
    """``state``, prefilled without a KV shadow, with an INT ``bits`` shadow quantized from its cache's
    first ``width`` slots: what a prefill with ``draft_kv=bits`` leaves (its forward writes the float
    pair, then ``sync_shadow`` quantizes the slots written)."""
    k, v = state.cache.k, state.cache.v
    cache = dataclasses.replace(init_cache(cfg, k.shape[1], k.shape[2], k.dtype, bits), k=k, v=v)
    positions = jnp.broadcast_to(jnp.arange(width), (k.shape[1], width))
    return dataclasses.replace(state, cache=jax.jit(sync_shadow)(cache, positions))


def trace_rows(trace: dict, context: int) -> tuple[int | None, dict]:
    """The draft -> gamma -> rounds table of ``trace`` to replay at ``context``: with per-context
    tables (``contexts``), the one recorded nearest to it (the shorter on a tie) and its context;
    else the file's own table and None."""
    if "contexts" not in trace:
        return None, trace
    nearest = min((int(c) for c in trace["contexts"]), key=lambda c: (abs(c - context), c))
    return nearest, trace["contexts"][str(nearest)]


def draft_rounds(table: dict, draft: str) -> dict | None:
    """``table``'s gamma -> rounds entry for the ``draft`` spec, under its own name or any spelling of
    the same spec (``w4a8/win512`` = ``w4a8/win512+64``); None without one."""
    if isinstance(table.get(draft), dict):
        return table[draft]
    spec = parse_draft(draft)
    for key, rounds in table.items():
        try:
            if isinstance(rounds, dict) and parse_draft(key) == spec:
                return rounds
        except ValueError:  # a metadata key
            continue
    return None


def trace_markdown(trace: dict) -> str:
    """A trace's tokens per round (1 + the mean accepted drafts over its rounds and sequences), one
    table per recorded context: draft spec x gamma."""
    tables = ({f"context {c} (prompts of {t['prompt_tokens']:.0f} tokens on average)": t
               for c, t in trace["contexts"].items()} if "contexts" in trace else {"chat-template questions": trace})
    device = "CPU" if trace.get("device") == "cpu" else trace.get("device", "device not recorded")
    kernels = trace.get("kernels", "not recorded")
    dtype = trace.get("dtype", "float32")
    label = f"{device} ({dtype} references)" if kernels == "reference" else f"{device} ({dtype}, {kernels} kernels)"
    lines = ["# QSPEC acceptance traces", "",
             f"{label}; date {trace.get('date', 'not recorded')}; commit {trace.get('commit', 'not recorded')}; "
             f"{trace.get('source', '')}.", "", f"`{trace.get('command', 'command not recorded')}`", "",
             "Tokens per round = 1 + the mean accepted drafts per round and sequence (rounds kept until the "
             "first sequence of the batch is done). A draft `MODE/kvBITS` reads an INT8 / INT4 shadow of the KV "
             "cache; `/winSIZE+SINKS` attends over the first SINKS and the last SIZE positions only; `/headROWS` "
             "computes the draft's logits over the ROWS most frequent tokens only (`q4`: from an INT4 copy of the "
             "head).", ""]
    # every table gets every draft and gamma any table holds: one missing from a table says so
    drafts = list(dict.fromkeys(d for t in tables.values() for d, r in t.items() if isinstance(r, dict)))
    gammas = sorted({int(g) for t in tables.values() for r in t.values() if isinstance(r, dict) for g in r})
    for title, table in tables.items():
        lines += [f"## {title[0].upper()}{title[1:]}", "", "| draft | " + " | ".join(f"γ={g}" for g in gammas) + " |",
                  "|---" * (1 + len(gammas)) + "|"]
        for d in drafts:
            r = table.get(d, {})
            cells = [f"{1 + np.mean(r[str(g)]):.2f}" if str(g) in r else "not recorded" for g in gammas]
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ report

def _over_floor(e: dict) -> str:
    """``draft / verify`` time as multiples of their phase floors (absent in older runs)."""
    if "draft_floor_ms" not in e:
        return ""
    return f"{e['draft_ms'] / e['draft_floor_ms']:.2f} / {e['verify_ms'] / e['verify_floor_ms']:.2f}"


def best_gamma(r: dict) -> dict[str, tuple[str, float]]:
    """Per draft: the QSPEC method with the best tokens/s among the fixed gammas measured, and its
    speed-up over W4A16 AR."""
    best: dict[str, tuple[str, float]] = {}
    for m, e in r.get("methods", {}).items():
        if m.startswith("qspec ") and not m.endswith("g=auto") and "speedup_vs_w4a16" in e:
            draft = m.split()[1]
            if draft not in best or e["speedup_vs_w4a16"] > best[draft][1]:
                best[draft] = (m, e["speedup_vs_w4a16"])
    return best


def summary(run: dict) -> list[str]:
    """One row per measured section: W4A16 tok/s, every other method's speed-up over it, each draft's
    best gamma; then the configurations skipped and why."""
    measured = [r for r in run["results"] if "skipped" not in r and "methods" in r]
    methods = list(dict.fromkeys(m for r in measured for m in r["methods"] if m != "w4a16"))
    drafts = list(dict.fromkeys(d for r in measured for d in best_gamma(r)))
    lines = ["| model | batch | context | W4A16 tok/s | " + " | ".join(m for m in methods)
             + "".join(f" | best γ ({d})" for d in drafts) + " |",
             "|---" * (4 + len(methods) + len(drafts)) + "|"]
    for r in measured:
        base = r["methods"].get("w4a16", {}).get("tokens_per_s")
        cells = []
        for m in methods:
            e = r["methods"].get(m)
            cells.append(f"{vs_w4a16(e, base):.2f}×" if e and base else "")
        best = best_gamma(r)
        cells += [f"γ={best[d][0].split('g=')[1]}: {best[d][1]:.2f}×" if d in best else "" for d in drafts]
        flag = " (not valid)" if r.get("disturbed") else ""
        lines.append(f"| {r['model']}{flag} | {r['batch']} | {r['context']} | {f'{base:.0f}' if base else ''} | "
                     + " | ".join(cells) + " |")
    skipped = [r for r in run["results"] if "skipped" in r]
    if skipped:
        lines += ["", "Not measured: " + "; ".join(f"{r['model']} batch {r['batch']} context {r['context']} "
                                                  f"({r['skipped']})" for r in skipped) + "."]
    return lines


def _not_run_text(not_run: dict[str, str]) -> str:
    """``{method: why}`` as sentences, the methods left out for one reason named together."""
    by_why: dict[str, list[str]] = {}
    for method, why in not_run.items():
        by_why.setdefault(why, []).append(method)
    return "".join(f"{', '.join(methods)} not measured: {why}. " for why, methods in by_why.items())


def markdown(run: dict) -> str:
    beside = any("w4a16_tokens_per_s_beside" in e for r in run["results"] for e in r.get("methods", {}).values())
    lines = [f"# Decode throughput ({run['device']})", "", f"`{run['command']}`", "",
             f"Copy bandwidth {run['copy_bw'] / 1e12:.2f} TB/s (this call; each section's floor uses its own "
             f"call's). Llama shapes: random weights (symmetric INT4, group {GROUP}), QSPEC acceptance "
             f"**replayed** from {run['trace_source']}; {REAL_MODEL}: real weights, few-shot GSM8K prompts, "
             "QSPEC's own (**measured**) acceptance. tok/s counts "
             "generated tokens of the whole batch; speed-ups are against W4A16 AR in the same run"
             + ("" if not beside else " (γ auto's, where the section says so: against the W4A16 AR loop timed "
                "alternately with it)") + "; "
             "floor = bytes one W4A16 step moves (weights + KV read at the mid context) / copy bandwidth; "
             "`x floor`: each QSPEC phase over the larger of that and its matmul FLOPs at the dense matmul rate "
             "(bf16 for the verify, int8 for the draft)"
             + (f", measured in this call at {run['matmul_rates']['bf16'] / 1e12:.0f} TFLOP/s bf16 and "
                f"{run['matmul_rates']['int8'] / 1e12:.0f} TOP/s int8" if "matmul_rates" in run else "")
             + ". A QSPEC round is one iteration of the batch's loop, which runs until its slowest sequence is "
             "done; tokens/round is the sequences' mean; batch tail = the loop's iterations / the sequences' "
             "mean rounds, so measured ≈ model / tail. α: the fraction of drafts accepted; model (α): docs/design.md "
             "§2's model with E[L] = (1 - α^(γ+1)) / (1 - α), as if each draft were accepted independently, "
             f"instead of the measured tokens per round. `generate`'s default is γ = {DEFAULT_GAMMA}, chosen round by round; best γ: the "
             "fastest fixed gamma measured; best gain (γ auto, where recorded): the most any γ could gain over "
             f"W4A16 steps by the cost model with every draft accepted, under {1 + MIN_GAIN:.2f} of which the auto "
             "loop is the W4A16 loop itself.", "", *summary(run), ""]
    for r in (r for r in run["results"] if "skipped" not in r):
        acceptance = r.get("acceptance", "replayed")
        prompt = f"; prompts of {r['prompt_tokens']:.0f} tokens on average" if "prompt_tokens" in r else ""
        if "trace_context" in r:
            prompt += f"; QSPEC's acceptance replayed from the trace recorded at context {r['trace_context']}"
        lines += [f"## {r['model']}, batch {r['batch']}, context {r['context']} + {r['new']}", "",
                  (f"Measured on {r['gpu']}, {r['date']}, commit {r['commit']}. " if "gpu" in r else "")
                  + (f"Note: {r['label']}. " if r.get("label") else "")
                  + _not_run_text(r.get("not_run", {}))
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
            elif "mean_gamma" in e:  # gamma="auto": timed whole, no phases
                timed = (f"; W4A16 AR beside it {e['w4a16_tokens_per_s_beside']:.0f} tok/s"
                         if "w4a16_tokens_per_s_beside" in e else "")
                gain = r.get("auto_best_gain", {}).get(m.removeprefix("qspec ").removesuffix(" g=auto"))
                if gain is not None:
                    timed += f"; best gain {gain:.3f}" + (" (< 1 + MIN_GAIN: the W4A16 loop)"
                                                          if not drafting_can_pay(gain) else "")
                lines.append(f"| {m} ({acceptance}) | {e['tokens_per_s']:.0f} | | {e['tokens_per_round']:.2f} "
                             f"(mean γ {e['mean_gamma']:.2f}{timed}) | {e['alpha']:.3f} | | | | "
                             f"{e.get('speedup_vs_w4a16', float('nan')):.2f}× | | | {mem} |")
            else:
                tail = f"{e['tail']:.2f}" if "tail" in e else "(in overhead)"
                alpha = f"{e['alpha']:.3f}" if "alpha" in e else ""
                model_alpha = f"{e['model_speedup_alpha']:.2f}×" if "model_speedup_alpha" in e else ""
                lines.append(f"| {m} ({acceptance}) | {e['tokens_per_s']:.0f} | {e['ms_per_round']:.2f} | "
                             f"{e['tokens_per_round']:.2f} | {alpha} | {tail} | {e['draft_ms']:.2f} / {e['verify_ms']:.2f} / "
                             f"{e['overhead_ms']:.2f} | {_over_floor(e)} | {e.get('speedup_vs_w4a16', float('nan')):.2f}× | "
                             f"{e.get('model_speedup', float('nan')):.2f}× | {model_alpha} | {mem} |")
        lines.append("")
    return "\n".join(lines)


AR = tuple(m for m in METHODS if m != "qspec")  # the autoregressive methods
ROOT = Path(__file__).resolve().parent.parent
# where a preset looks for the GSM8K files SmolLM2's prompts come from ($QSPEC_JAX_DATA first)
DATA_DIRS = tuple(Path(d) for d in [os.environ.get("QSPEC_JAX_DATA")] if d) + (ROOT.parent / "shared" / "data",)
CALIBRATION = ROOT / "bench" / "results" / "decode.json"  # recorded sections that calibrate the cost model
PRESETS = {
    "headline": {"models": f"llama2-7b,llama3-8b,llama2-13b,{REAL_MODEL}", "batches": "1,8,16,32",
                 "contexts": "512,4096", "new": "512", "gammas": "1,3", "drafts": DEFAULT_DRAFT_VIEW,
                 "ar": "w4a16,w4a8", "auto": True, "trace": str(CONTEXT_TRACE), "phase_reps": "8", "real_contexts": "512"},
    "full": {"models": f"llama3-8b,llama2-7b,llama2-13b,llama2-70b,{REAL_MODEL}", "batches": "1,8,16,32,64",
             "contexts": "512,4096", "new": "512", "gammas": "1,3,5", "drafts": "w4a8,w4a4,w4a8/kv8",
             "ar": "w16a16,w4a16,w4a8,w4a4", "trace": str(DEFAULT_TRACE), "phase_reps": "16"},
    # the headline's methods on the tiny model, for a check of the whole tool on the CPU
    "smoke": {"models": "smoke", "batches": "2", "contexts": "32,64", "new": "8", "gammas": "1,3",
              "drafts": DEFAULT_DRAFT_VIEW, "ar": "w4a16,w4a8", "auto": True, "trace": str(CONTEXT_TRACE),
              "phase_reps": "2", "kernels": "reference"},
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a matrix's defaults (headline: the README's table; full: everything; smoke: a CPU check); "
                         "flags override")
    ap.add_argument("--plan", choices=["here", *CARDS], default=None,
                    help="print the matrix, what fits and the estimated time on this GPU or on an H100 / H200, "
                         "then exit without measuring")
    ap.add_argument("--models", default="llama3-8b,llama2-7b,llama2-13b")
    ap.add_argument("--batches", type=int_list(), default="1,8,16,32,64")
    ap.add_argument("--contexts", type=int_list(), default="512")
    ap.add_argument("--real-contexts", type=int_list(), default=None,
                    help=f"{REAL_MODEL}'s contexts (default: --contexts)")
    ap.add_argument("--new", type=positive_int, default=512)
    ap.add_argument("--gammas", type=int_list(), default="1,3,5")
    ap.add_argument("--drafts", default="w4a8,w4a4")
    ap.add_argument("--auto", action="store_true",
                    help=f"also time each draft with gamma='auto' (gamma 0..{AUTO_GAMMA_MAX} chosen per round)")
    ap.add_argument("--ar", default="w16a16,w4a16,w4a8,w4a4", help=f"autoregressive methods, of {', '.join(AR)}")
    ap.add_argument("--kernels", default="auto", choices=KERNELS)
    ap.add_argument("--trace", type=Path, help="acceptance trace JSON (from --record-trace)")
    ap.add_argument("--record-trace", type=Path, help="record the trace on SmolLM2 into this file and exit")
    ap.add_argument("--trace-contexts", type=int_list(), default=None,
                    help="with --record-trace: one table per context, on few-shot prompts of at most that many "
                         "tokens (default: one table on the plain chat questions)")
    ap.add_argument("--gsm8k", type=Path, help="GSM8K-dev JSONL (for --record-trace and smollm2's prompts)")
    ap.add_argument("--gsm8k-train", type=Path, help="GSM8K-train JSONL (smollm2's few-shot prompt prefixes)")
    ap.add_argument("--prompts", type=positive_int, default=32)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    ap.add_argument("--resume", type=Path, default=None, help="an earlier decode.json: its configurations are kept")
    ap.add_argument("--label", default="", help="a note on the code measured, kept with each new section")
    ap.add_argument("--rerun", action="store_true",
                    help="with --resume: measure the configurations named here again, replacing the old ones")
    ap.add_argument("--budget-s", type=positive_seconds, default=float("inf"),
                    help="start no configuration estimated to end after this many seconds")
    ap.add_argument("--threads", type=positive_int, default=min(8, os.cpu_count() or 1), help="compiles at once")
    ap.add_argument("--reps", type=positive_int, default=1,
                    help="timed runs of each decode loop after its short warm-up (the best is kept)")
    ap.add_argument("--phase-reps", type=positive_int, default=FORWARD_REPS,
                    help="forwards per timed QSPEC phase loop")
    return ap


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, set[str]]:
    """The arguments, a ``--preset``'s values as defaults (flags given explicitly override them), and
    the destinations given explicitly."""
    ap = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    preset = ap.parse_known_args(argv)[0].preset
    if preset:
        ap.set_defaults(**PRESETS[preset])
    args = ap.parse_args(argv)
    explicit = {a.dest for a in ap._actions for arg in argv for opt in a.option_strings
                if arg == opt or arg.startswith(opt + "=")}
    args.drafts = [d for d in args.drafts.split(",") if d]
    seen: dict[DraftSpec, str] = {}
    for d in args.drafts:
        try:
            spec = parse_draft(d)
        except ValueError as e:
            ap.error(str(e))
        if spec in seen:
            ap.error(f"--drafts: {seen[spec]} and {d} are the same draft")
        seen[spec] = d
    if args.trace_contexts and not args.record_trace:
        ap.error("--trace-contexts goes with --record-trace")
    args.ar = [m for m in args.ar.split(",") if m]
    if unknown_ar := [m for m in args.ar if m not in AR]:
        ap.error(f"--ar: unknown methods {unknown_ar}; expected some of {', '.join(AR)}")
    args.models = [n for n in args.models.split(",") if n]
    return args, explicit


def real_model_missing(args) -> str | None:
    """Why SmolLM2 cannot run here (no GSM8K files, no checkpoint), or None."""
    if not (args.gsm8k and args.gsm8k_train):
        return "it needs --gsm8k and --gsm8k-train (GSM8K dev / train JSONL), not found in " + \
            " or ".join(str(d) for d in DATA_DIRS)
    if args.checkpoint is not None:
        return None if (args.checkpoint / "manifest.json").is_file() else f"no checkpoint at {args.checkpoint}"
    from convert.embedded import cache_dir, embedded_gguf

    if (cache_dir() / "smollm2-rtn-asym-g32" / "manifest.json").is_file():
        return None
    try:
        embedded_gguf()  # converted on first use
    except FileNotFoundError as e:
        return f"no converted checkpoint in {cache_dir()} and {e}"
    return None


def _preset_real_model(args, explicit: set[str]) -> None:
    """A preset finds SmolLM2's GSM8K files by itself, and leaves SmolLM2 out (saying why) where they
    or its checkpoint are missing; a model list given explicitly is kept as given."""
    for dest, name in (("gsm8k", "gsm8k_test_dev.jsonl"), ("gsm8k_train", "gsm8k_train.jsonl")):
        if getattr(args, dest) is None:
            setattr(args, dest, next((d / name for d in DATA_DIRS if (d / name).is_file()), None))
    if "models" not in explicit and REAL_MODEL in args.models and (why := real_model_missing(args)):
        log(f"{REAL_MODEL} left out of the {args.preset} preset: {why}")
        args.models.remove(REAL_MODEL)


def _check_trace(args, trace: dict, names: list[str]) -> None:
    """Before anything is timed: every draft and gamma has valid rounds in the table each random-weight
    configuration replays (per context, the recorded context nearest to it)."""
    random = [n for n in names if n != REAL_MODEL]
    if args.drafts and not args.trace and random:
        raise SystemExit("QSPEC on random weights needs --trace (make one with --record-trace)")
    if not (args.drafts and random):
        return
    contexts = trace.get("contexts")
    if contexts is not None and not (isinstance(contexts, dict) and contexts and all(
            c.isdigit() and isinstance(t, dict) for c, t in contexts.items())):
        raise SystemExit(f"--trace {args.trace}: 'contexts' must map each recorded context to its table")
    for context in sorted({c for n in random for c in _contexts(n, args)}):
        at, table = trace_rows(trace, context)
        where = "" if at is None else f" at context {at} (the recorded context nearest to {context})"
        for d in args.drafts:
            rounds = draft_rounds(table, d) or {}
            missing = [g for g in args.gammas if str(g) not in rounds]
            if missing:
                raise SystemExit(f"the trace {args.trace} has no {d} rounds{where} for gamma {missing}")
            checked = list(args.gammas)
            if args.auto:
                try:
                    auto_rounds(rounds)
                except ValueError as e:
                    raise SystemExit(f"the trace {args.trace}, {d} rounds{where}: {e}") from None
                checked.append(min(int(g) for g in rounds if int(g) >= AUTO_GAMMA_MAX))
            for g in checked:
                r = rounds[str(g)]
                if not (isinstance(r, list) and r and all(isinstance(x, list) and x and all(
                        isinstance(a, int) and 0 <= a <= g for a in x) for x in r)):
                    raise SystemExit(f"the trace's {d} gamma-{g} entry{where} must be a non-empty list of rounds, "
                                     f"each a non-empty list of accepted counts in [0, {g}]")


def prior_pace(resume: dict | None) -> tuple[float, float, str]:
    """(pace for the total estimate, pace the budget assumes before this call measures one, source):
    the median and the largest of :func:`calibrated_pace` over the resumed run's and
    :data:`CALIBRATION`'s sections, else :data:`PACE` for both."""
    sections = list(resume["results"]) if resume else []
    if CALIBRATION is not None and Path(CALIBRATION).is_file():
        try:
            sections += json.loads(Path(CALIBRATION).read_text()).get("results", [])
        except (OSError, ValueError, AttributeError):
            pass
    got = calibrated_pace([r for r in sections if isinstance(r, dict)])
    if got is None:
        return PACE, PACE, "no recorded sections"
    return got[0], got[1], "recorded sections"


def main(argv: list[str] | None = None) -> None:
    args, explicit = parse_args(argv)
    if args.record_trace:
        if not args.gsm8k:
            raise SystemExit("--record-trace needs --gsm8k")
        if args.trace_contexts and not args.gsm8k_train:
            raise SystemExit("--trace-contexts needs --gsm8k-train (the few-shot examples)")
        record_trace(args, command_line("bench.decode", argv))
        return
    if args.preset:
        _preset_real_model(args, explicit)
    names = args.models
    unknown = [n for n in names if n not in MODELS and n != REAL_MODEL]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join([*MODELS, REAL_MODEL])}")
    if REAL_MODEL in names and not (args.gsm8k and args.gsm8k_train):
        raise SystemExit(f"{REAL_MODEL} (real prompts) needs --gsm8k and --gsm8k-train")
    trace = read_json(args.trace, "--trace") if args.trace else {}
    _check_trace(args, trace, names)
    for n in names:
        if n in MODELS and max(args.contexts) + args.new > MODELS[n].max_position_embeddings:
            raise SystemExit(f"{n}: context {max(args.contexts)} + {args.new} new tokens exceeds its "
                             f"{MODELS[n].max_position_embeddings} positions")
    old = read_json(args.resume, "--resume", {"command": str, "results": list}) if args.resume else None
    budget = Budget(time.perf_counter() + args.budget_s)
    command = command_line("bench.decode", argv)
    run = {"command": command, "results": []}
    if old is not None:
        run["results"] = [r for r in old["results"] if "skipped" not in r]
        run["command"] = f"{old['command']}; then {command}"
    batches = args.batches
    grid = [(n, c, b) for n in names for c in _contexts(n, args) for b in batches]
    done = set()
    for r in run["results"]:  # a disturbed section, or one that lacks what this run measures, is measured again
        if (why := "disturbed" if r.get("disturbed") else _lacks(r, args)) is None:
            done.add(_key(r))
        elif _key(r) in grid:
            log(f"{r['model']} B={r['batch']} ctx={r['context']}: measured again, the earlier section is {why}")
    if args.rerun:  # measured again; each old section stays until its new one replaces it (record)
        done -= set(grid)
    if args.plan in CARDS:
        (bw, card), device = CARDS[args.plan], args.plan.upper() + " (assumed)"
        limit = MEM_HEADROOM * card  # as memory_limit() on that card
    else:
        bw, limit, device = copy_bandwidth(), memory_limit(), jax.devices()[0].device_kind
    median, budget.prior, source = prior_pace(old)
    todo = [t for t in grid if t not in done]
    costs = {t: config_cost_s(*t, args, bw, limit) for t in todo}
    too_large = [t for t in todo if costs[t] == 0.0]
    total = median * sum(costs.values())
    log(f"{args.preset or 'custom'} matrix on {device}: {len(grid)} configurations, {len(grid) - len(todo)} done, "
        f"{len(todo) - len(too_large)} to measure"
        + (f", {len(too_large)} too large for {limit / 1e9:.0f} GB (skipped)" if limit < float("inf") else "")
        + f"; estimated {total / 60:.1f} min ({median:.2f} x the cost model, from {source}; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s)")
    if args.plan:
        for t in todo:
            log(f"  {t[0]} ctx={t[1]} B={t[2]}: "
                + (f"~{median * costs[t]:.0f} s" + _plan_left_out(*t, args, limit) if costs[t] else "too large: skipped"))
        return
    rates = matmul_rates()
    run |= {"device": jax.devices()[0].device_kind, "copy_bw": bw, "matmul_rates": rates,
            "trace_source": trace.get("source", "-")}
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s; dense matmul {rates['bf16'] / 1e12:.0f} TFLOP/s bf16, "
        f"{rates['int8'] / 1e12:.0f} TOP/s int8")
    meta = {"gpu": run["device"], "date": utc_now(), "commit": git_commit(), "command": command}
    for name, context, batch in too_large:  # on the estimate, without loading the model
        cfg, packed = MODELS[name], matmul_flops_per_token(MODELS[name]) / 4  # as config_cost_s estimates
        ar_only = argparse.Namespace(**{**vars(args), "drafts": []})
        need = memory_need(packed, cfg, context, batch, ar_only, runs_w16a16(packed, cfg, args, limit))
        _skip(run, name, context, batch, args, need, limit, meta)
    for name in names:
        todo_model = [(c, b) for c in _contexts(name, args) for b in batches
                      if (name, c, b) not in done and (name, c, b) not in too_large]
        if todo_model:
            _bench_model(name, todo_model, args, trace, bw, rates, run, budget, limit, meta)
    save(run, args.out)
    print("\n".join(summary(run)))  # the full tables: decode.md
    measured = {_key(r) for r in run["results"] if "skipped" not in r and not r.get("disturbed")
                and _lacks(r, args) is None}
    skipped = {_key(r) for r in run["results"] if "skipped" in r}
    left = [t for t in grid if t not in measured and t not in skipped]
    log(f"{len(left)} of {len(grid)} configurations remain"
        + (f" (~{median * sum(config_cost_s(*t, args, bw, limit) for t in left) / 60:.1f} min): continue with "
           f"--resume {args.out / 'decode.json'}" if left else "") + (f"; {len(skipped)} skipped" if skipped else ""))


def _plan_left_out(name: str, context: int, batch: int, args, limit: float) -> str:
    """``--plan``'s note of the drafts a configuration leaves out for memory (as :func:`config_cost_s` estimates)."""
    if name == REAL_MODEL:
        return ""
    cfg, packed = MODELS[name], matmul_flops_per_token(MODELS[name]) / 4
    fit = fitting(args, packed, cfg, context, batch, runs_w16a16(packed, cfg, args, limit), limit)[0]
    dropped = [d for d in args.drafts if d not in fit.drafts]
    return f" (without {', '.join(dropped)}: too large)" if dropped else ""


def _skip(run: dict, name: str, context: int, batch: int, args, need: float, limit: float, meta: dict) -> None:
    log(f"{name} B={batch} ctx={context}: skipped, needs ~{need / 1e9:.0f} GB of {limit / 1e9:.0f} GB")
    record(run, {"model": name, "batch": batch, "context": context, "new": args.new,
                 "skipped": f"needs ~{need / 1e9:.0f} GB, more than the {limit / 1e9:.0f} GB it may use on this "
                            f"{meta['gpu']}", "skip_reason": "memory"})


def _contexts(name: str, args) -> list[int]:
    return args.real_contexts if name == REAL_MODEL and args.real_contexts else args.contexts


def _bench_model(name: str, todo: list[tuple[int, int]], args, trace: dict, bw: float, rates: dict[str, float],
                 run: dict, budget: Budget, limit: float, meta: dict) -> None:
    """Every (context, batch) of ``todo`` for one model that ``budget`` lets start, each compiled and
    then timed (never both at once), appended to ``run`` and saved after each."""
    if not any(budget.fits(config_cost_s(name, context, batch, args, bw, limit)) for context, batch in todo):
        log(f"{name}: no configuration fits the {max(budget.left(), 0):.0f} s left of the budget, not loaded")
        return
    model = load(args.checkpoint or default_checkpoint()) if name == REAL_MODEL else None
    cfg = MODELS[name] if model is None else model.config
    params = random_params(cfg, jax.random.key(1)) if model is None else model.checkpoint.params
    w16a16 = runs_w16a16(weight_bytes(params), cfg, args, limit)
    not_run = {}
    if "w16a16" in args.ar and not w16a16:
        not_run["w16a16"] = f"its bf16 weights do not fit the {limit / 1e9:.0f} GB"
        log(f"{name}: w16a16 not measured, {not_run['w16a16']}")
    fparams = float_params(params) if w16a16 else None
    # random weights: a draft head of the first rows (the bytes are what matter); real ones: the checkpoint's
    heads = {d: parse_draft(d) for d in args.drafts if parse_draft(d).head}
    draft_params = {d: spec.with_head(params, cfg) if model is None else
                    _checkpoint_head_params(model, spec) for d, spec in heads.items()}
    for context, batch in todo:
        fit, left_out = fitting(args, weight_bytes(params), cfg, context, batch, w16a16, limit)
        if fit is None:
            need = memory_need(weight_bytes(params), cfg, context, batch, argparse.Namespace(**{**vars(args), "drafts": []}),
                               w16a16)
            _skip(run, name, context, batch, args, need, limit, meta)
            continue
        if left_out:
            log(f"{name} B={batch} ctx={context}: without {', '.join(d for d in args.drafts if d not in fit.drafts)} "
                f"({next(iter(left_out.values()))})")
        estimate = config_cost_s(name, context, batch, args, bw, limit)
        if not budget.fits(estimate):
            log(f"{name} B={batch} ctx={context}: not started, ~{budget.pace() * estimate:.0f} s estimated, "
                f"{max(budget.left(), 0):.0f} s of the budget left")
            continue
        log(f"{name} B={batch} ctx={context}")
        t0 = time.perf_counter()
        c = plan_config(name, cfg, params, fparams, batch, context, fit, trace if model is None else None, bw, model,
                        draft_params)
        compiled = compile_config(c, args.threads)
        waited = time.perf_counter() - t0
        log(f"  {len(compiled)} programs ready after {waited:.0f} s")
        t1 = time.perf_counter()
        res = run_config(c, compiled, params, fparams, fit, rates)
        if not res["methods"]:  # every method ran out of memory
            res = {**res, "skipped": OUT_OF_MEMORY, "skip_reason": "memory"}
        reason = phase_check(res)
        if reason:
            log(f"  not a valid measurement: {reason}")
            res["disturbed"] = reason
        del compiled  # its executables and buffers, before the next configuration's states
        res["bench_s"] = {"compile_wait": waited, "timing": time.perf_counter() - t1}  # the benchmark's own cost
        budget.measured(estimate, time.perf_counter() - t0)
        not_run_here = not_run | left_out | res.pop("not_run", {})
        res |= meta | ({"not_run": not_run_here} if not_run_here else {}) | (
            {"label": args.label} if args.label else {})
        record(run, res)
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
    want = {*args.ar, *(m for d in args.drafts for m in qspec_methods(d, args))}
    if missing := sorted(want - set(r.get("methods", {})) - set(r.get("not_run", {}))):
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
    (out / "decode.md").write_text(markdown(run))


if __name__ == "__main__":
    main()
