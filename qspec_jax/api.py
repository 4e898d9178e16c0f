"""The user-facing API: ``load()`` a converted checkpoint and ``generate()`` with QSPEC or a baseline."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference
from pallas_kernels.precision import DRAFT_PRECISIONS, W4A8, W4A16, W16A16, W4A4, parse_precision
from qspec_jax.checkpoint import Checkpoint, load_checkpoint
from qspec_jax.core import AUTO_GAMMA_MAX, Decoder, decode_jit, init_state, prefill_jit
from qspec_jax.decode import FINISH_REASONS, MAX_GAMMA, STOP, Runtime, buffer_length, pad_prompts
from qspec_jax.kernels import Execution
from qspec_jax.model import DRAFT_HEAD_BITS, with_draft_head
from qspec_jax.gamma import cost_model
from qspec_jax import sharding
from qspec_jax.sampling import Sampling, check_token_ids, is_integer, per_row

AR_PRECISIONS = (W4A16, W4A8, W4A4, W16A16)  # the autoregressive methods
METHODS = ("qspec", *(p.name for p in AR_PRECISIONS))
DRAFTS = tuple(p.name for p in DRAFT_PRECISIONS)
DEFAULT_DRAFT, DEFAULT_GAMMA = W4A8.name, "auto"  # generate()'s, also the CLI's
DEFAULT_SINKS = 64  # a draft window's first slots (one KV block of the attention kernel)
# generate()'s draft window: no memory, a draft reads at most this many cached tokens; the acceptance it
# keeps at long context is in bench/results/acceptance_contexts.md
DEFAULT_WINDOW = 1024
# Prompts are padded to a multiple of PROMPT_MULTIPLE and the room for new tokens rounded up to one of
# NEW_TOKENS_MULTIPLE: calls in one bucket share the compiled prefill and decode loop (pad tokens sit
# after a sequence's last position, unused slots past its budget: invisible to it)
PROMPT_MULTIPLE = 64
NEW_TOKENS_MULTIPLE = 64
COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded checkpoint and its tokenizer (``None`` if the checkpoint has none)."""

    checkpoint: Checkpoint
    tokenizer: Any
    # the params of each (draft head, tensor-parallel degree) asked for: built once (an INT4 head is quantized on
    # the host, shards laid out and placed)
    _built: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def config(self):
        return self.checkpoint.config

    def decode_params(self, draft_head: tuple[int | None, int] | None = None, tensor_parallel: int = 1) -> dict[str, Any]:
        """The params a decode reads: with ``draft_head = (rows, bits)`` plus a draft head of the ranking's
        first ``rows`` tokens (None: the whole head) at ``bits`` (:func:`qspec_jax.model.with_draft_head`);
        for ``tensor_parallel`` > 1 laid out and placed on the devices (:func:`qspec_jax.sharding.shard_params`).
        Built on the first call and kept."""
        head = None if draft_head is None else (None if draft_head[0] is None else int(draft_head[0]), int(draft_head[1]))
        key = (head, int(tensor_parallel))
        if key not in self._built:
            ck = self.checkpoint
            params = ck.params
            if head is not None:
                params = with_draft_head(params, ck.config, None if head[0] is None else ck.draft_vocab, *head)
            if tensor_parallel > 1:
                params = sharding.shard_params(params, ck.config, tensor_parallel)
            self._built[key] = params
        return self._built[key]


def load(path: str | Path) -> Model:
    """Load a converted checkpoint (the embedded SmolLM2's: ``convert.embedded.default_checkpoint()``)."""
    from qspec_jax.tokenizer import load_tokenizer

    if path is None:
        raise ValueError("load() needs a checkpoint path (the embedded SmolLM2's: "
                         "convert.embedded.default_checkpoint())")
    path = Path(path).expanduser()
    ck = load_checkpoint(path)
    tok = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return Model(ck, tok)


@dataclasses.dataclass
class GenerationResult:
    """Generated tokens per prompt, why each stopped, decoded texts and decoding statistics.

    ``finish_reasons``: ``"stop"`` (an EOS token or a stop string) or ``"length"``.
    ``stats``: ``generated`` tokens (by the decode loop, before any stop-string cut), ``wall_time_s`` (prefill + decode, and compilation on the first
    call of a shape), ``tokens_per_s``; QSPEC adds ``rounds``, ``drafted``, ``accepted``,
    ``acceptance_rate`` and ``tokens_per_round``, and with ``gamma="auto"`` ``best_gain`` (the most
    drafting could gain over W4A16 steps by the cost model, every draft accepted: under
    ``1 + MIN_GAIN`` no round drafts), an autoregressive method ``steps``."""

    sequences: list[np.ndarray]
    prompt_lengths: np.ndarray
    lengths: np.ndarray
    finish_reasons: list[str]
    texts: list[str] | None
    stats: dict[str, float]
    logprobs: list[np.ndarray] | None = None  # per generated token (return_logprobs=True)


@dataclasses.dataclass
class StreamUpdate:
    """What :func:`stream_generate` yields: per prompt the tokens and text added since the last update,
    whether it is finished; the last update also carries the whole :class:`GenerationResult`."""

    tokens: list[np.ndarray]
    texts: list[str] | None
    finished: list[bool]
    result: GenerationResult | None = None


def _is_conversation(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p)


def tokenize(model: Model, prompts, chat: bool, system: str | None = None) -> list[list[int]]:
    """Token ids of each prompt (strings and conversations through the tokenizer; ``system``: a system
    message before each chat prompt), checked against the vocabulary."""
    if isinstance(prompts, str) or _is_conversation(prompts):
        prompts = [prompts]
    if system is not None and not chat:
        raise ValueError("system= is a chat message: it needs chat=True")
    if getattr(prompts, "ndim", 1) == 0 or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be a string, a list of strings or a list of token-id sequences, "
                         f"got {type(prompts).__name__}")
    if getattr(prompts, "ndim", None) == 1:  # one token-id prompt as a NumPy or JAX array
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str) or _is_conversation(p):
            if model.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass token ids instead of strings")
            if chat:
                from qspec_jax.tokenizer import chat_prompt
                ids = np.asarray(chat_prompt(model.tokenizer, p, system), np.int64)
            elif not isinstance(p, str):
                raise ValueError("a list of messages is a conversation for the chat template: it needs chat=True")
            else:
                ids = np.asarray(model.tokenizer.encode(p, add_special_tokens=False), np.int64)
        else:
            if chat:
                raise ValueError("chat=True wraps string prompts in the chat template; a token-id prompt is used "
                                 "as given (format it with qspec_jax.tokenizer.chat_prompt first)")
            ids = np.asarray(p)
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(f"a token-id prompt must be a 1-D integer sequence, got shape {ids.shape} "
                                 f"dtype {ids.dtype} (prompts are a list of them: [[1, 2, 3]])")
        check_token_ids(ids, model.config.vocab_size,
                        " from the tokenizer: it does not match the model" if isinstance(p, str) else "")
        out.append(ids.astype(np.int64).tolist())
    return out


def default_dtype(backend: str | None = None) -> Any:
    """``generate``'s compute dtype when none is given: bfloat16 on a GPU backend (the kernels'
    native input), float32 elsewhere (XLA's CPU bf16 dots are slow). ``backend``: ``jax.default_backend()``
    where None."""
    return jnp.bfloat16 if (jax.default_backend() if backend is None else backend) == "gpu" else jnp.float32


def seed_key(seed: int) -> jax.Array:
    """A threefry key from all 64 bits of ``seed`` (two's complement): ``jax.random.key`` keeps only
    the low 32 bits unless 64-bit mode is on, so seeds 0 and 2**32 would draw the same tokens. For
    seeds in [0, 2**31) it is ``jax.random.key(seed)``."""
    u = seed & (2**64 - 1)
    return jax.random.wrap_key_data(jnp.array([u >> 32, u & 0xFFFFFFFF], jnp.uint32), impl="threefry2x32")


def _draft_window(method: str, size: int | None, sinks: int) -> reference.AttentionWindow | None:
    """generate()'s ``draft_window`` / ``draft_sinks`` as the drafts' attention window (None: none; the
    autoregressive methods take only the defaults, which do not apply to them)."""
    if method != "qspec":
        if size not in (None, DEFAULT_WINDOW) or sinks != DEFAULT_SINKS:
            raise ValueError(f"draft_window and draft_sinks apply to method 'qspec' only; got draft_window={size!r}, "
                             f"draft_sinks={sinks!r} with method {method!r}")
        return None
    if size is None:
        if sinks != DEFAULT_SINKS:
            raise ValueError(f"draft_sinks={sinks!r} needs a draft_window")
        return None
    if not is_integer(size) or size < 1:
        raise ValueError(f"draft_window must be None or an integer >= 1, got {size!r}")
    if not is_integer(sinks) or sinks < 0:
        raise ValueError(f"draft_sinks must be an integer >= 0, got {sinks!r}")
    return reference.AttentionWindow(int(sinks), int(size))


def generate(model: Model, prompts: str | Sequence[str] | Sequence[Sequence[int]] | np.ndarray, *,
             max_new_tokens: int | Sequence[int], method: str = "qspec", draft: str | None = None,
             gamma: int | str | None = None,
             draft_kv: int | None = None, draft_window: int | None = DEFAULT_WINDOW,
             draft_sinks: int = DEFAULT_SINKS,
             draft_head: int | None = None, draft_head_bits: int = 16,
             temperature: float | Sequence[float] = 0.0, top_k: int | Sequence[int | None] | None = None,
             top_p: float | Sequence[float | None] | None = None, seed: int = 0,
             eos_token_id: int | Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
             chat: bool = False, system: str | None = None, return_logprobs: bool = False,
             max_len: int | None = None, tensor_parallel: int = 1,
             dtype: Any = None, kernels: str = "auto") -> GenerationResult:
    """Generate continuations of ``prompts`` (strings or token-id sequences) with ``method``.

    ``qspec`` drafts ``gamma`` tokens per round (default :data:`DEFAULT_GAMMA`) in ``draft`` precision
    (default :data:`DEFAULT_DRAFT`) and verifies them in W4A16 (``"auto"``: each round's γ in ``0..AUTO_GAMMA_MAX`` from a bytes cost model of the phases and the
    acceptance so far, :mod:`qspec_jax.gamma`; γ = 0 runs ``AUTO_GAMMA_MAX + 1`` W4A16 steps; where drafting could
    gain less than :data:`qspec_jax.gamma.MIN_GAIN` with every draft accepted, every round is γ = 0); the other methods decode
    autoregressively in that mode and refuse ``draft`` / ``gamma``. ``draft_kv`` (8 or 4, ``qspec`` only):
    the drafts attend over an INT8 / INT4 copy of the KV cache kept beside it, reading fewer bytes
    per draft step; the verifier still reads only its own float cache, so the output is unchanged.
    ``draft_window`` (``qspec`` only; default :data:`DEFAULT_WINDOW`, None: the whole cache): the drafts
    attend over the first ``draft_sinks`` slots and the ``draft_window`` slots ending at their own
    position only (alone or with ``draft_kv``); it costs no memory and changes nothing below that length.
    ``draft_head`` (``qspec`` only, a checkpoint converted with ``--draft-vocab``): the drafts compute
    logits for that many of the calibration text's most frequent tokens only, from a copy of those
    lm_head rows; the verifier keeps the full head. ``draft_head_bits`` 4 (``qspec`` only): that copy
    (or, without ``draft_head``, a copy of the whole head) is INT4, a quarter of the float head's bytes.
    Prefill runs in W4A16 (W16A16 for ``w16a16``). ``max_len`` bounds prompt + new tokens (at most,
    and by default, the model's ``max_position_embeddings``). ``tensor_parallel``: split the heads, MLP
    features, lm_head and KV cache over that many devices (:mod:`qspec_jax.sharding`; each forward sums
    o's and down's results over them, the same way in every method).
    ``eos_token_id``: the token(s) that end a sequence, by default the tokenizer's EOS and the config's
    (all of them, where it lists several); ``-1`` never stops on a token.
    ``temperature`` 0 decodes greedily; above 0 tokens are sampled (key from ``seed``), ``top_k`` /
    ``top_p`` restricting the distribution. ``max_new_tokens``, ``temperature``, ``top_k`` and ``top_p``
    may be lists with one value per prompt; they are arrays in the compiled loop, so new values reuse it
    (while every sequence is greedy the loop skips the sampling work: going from all-greedy to sampling
    compiles once more). ``stop``: strings that end a sequence's text; each is cut
    after the token that completes the first match and its text before the match (the loop itself runs
    on to EOS or ``max_new_tokens``: the cut is made on the host). ``chat`` wraps string prompts in the
    chat template; a prompt may also be a conversation, a list of ``{"role", "content"}`` messages
    (or ``prompts`` one conversation); ``system`` puts a system message first. ``return_logprobs``:
    each generated token's log-probability (log-softmax of the raw logits, before temperature) under
    the logits that chose it: for QSPEC the W4A16 verifier's (equal to W4A16 decoding's, greedy).
    ``dtype``: the activations' and KV cache's float type (float32, bfloat16 or float16); None:
    bfloat16 on a GPU backend, float32 elsewhere (:func:`default_dtype`).
    ``kernels`` picks the Pallas GPU kernels or the jnp references (:mod:`qspec_jax.kernels`;
    ``"auto"``: the kernels on a GPU). Prompts are padded to a multiple of :data:`PROMPT_MULTIPLE`
    tokens and the room for new tokens to one of :data:`NEW_TOKENS_MULTIPLE`, so calls in the same
    buckets reuse the compiled code. Streamed: :func:`stream_generate`; the functional core beneath
    both: :mod:`qspec_jax.core`.
    """
    options = {k: v for k, v in locals().items() if k not in ("model", "prompts")}  # every keyword above
    *_, last = _generation(model, prompts, None, **options)
    return last.result


def stream_generate(model: Model, prompts, *, chunk_rounds: int = 8, **options: Any) -> Iterator[StreamUpdate]:
    """:func:`generate` (same ``options``) yielding each sequence's new tokens and text every
    ``chunk_rounds`` rounds of the compiled loop (a traced bound: no recompilation per chunk); the
    last update's ``result`` is :func:`generate`'s result. A sequence whose text reaches a ``stop``
    string stops decoding there; text that could begin a stop string is held back until it cannot."""
    try:  # generate's defaults, and its TypeError for an unknown or missing option
        bound = inspect.signature(generate).bind(model, prompts, **options)
    except TypeError as e:
        raise TypeError(f"stream_generate: {e}") from None
    bound.apply_defaults()
    yield from _generation(model, prompts, chunk_rounds, **{k: v for k, v in bound.arguments.items()
                                                              if k not in ("model", "prompts")})


def _generation(model: Model, prompts, chunk_rounds: int | None, *, max_new_tokens, method, draft, gamma, draft_kv,
                draft_window, draft_sinks, draft_head, draft_head_bits, temperature, top_k, top_p, seed, eos_token_id,
                stop, chat, system, return_logprobs, max_len, tensor_parallel, dtype, kernels) -> Iterator[StreamUpdate]:
    """:func:`generate` as updates: the loop runs ``chunk_rounds`` rounds at a time (None: to the end)
    and each chunk's new tokens and text are yielded; the last update carries the result."""
    if chunk_rounds is not None and (not is_integer(chunk_rounds) or chunk_rounds < 1):
        raise ValueError(f"chunk_rounds must be an integer >= 1, got {chunk_rounds!r}")
    if not isinstance(model, Model):
        raise ValueError(f"model must be a qspec_jax.Model (from qspec_jax.load(path)), got {type(model).__name__}")
    ar = None if method == "qspec" else parse_precision(method, AR_PRECISIONS, "method", others=("qspec",))
    if ar is not None and (given := [n for n, v in (("draft", draft), ("gamma", gamma)) if v is not None]):
        raise ValueError(f"{' and '.join(given)} apply to method 'qspec' only; method {method!r} decodes "
                         "autoregressively (leave them out)")
    draft = parse_precision(DEFAULT_DRAFT if draft is None else draft, DRAFT_PRECISIONS, "draft precision")
    gamma = DEFAULT_GAMMA if gamma is None else gamma
    if draft_kv is not None and (method != "qspec" or not is_integer(draft_kv) or draft_kv not in reference.KV_BITS):
        raise ValueError(f"draft_kv must be None or one of {reference.KV_BITS}, with method 'qspec'; got "
                         f"draft_kv={draft_kv!r} with method {method!r}")
    window = _draft_window(method, draft_window, draft_sinks)
    if draft_head_bits not in DRAFT_HEAD_BITS or (draft_head_bits != 16 and method != "qspec"):
        raise ValueError(f"draft_head_bits must be one of {DRAFT_HEAD_BITS} (4: method 'qspec' only); got "
                         f"draft_head_bits={draft_head_bits!r} with method {method!r}")
    if draft_head is not None:
        if method != "qspec" or not is_integer(draft_head) or not 1 <= draft_head <= model.config.vocab_size:
            raise ValueError(f"draft_head must be None or an integer in [1, {model.config.vocab_size}], with method "
                             f"'qspec'; got draft_head={draft_head!r} with method {method!r}")
        if model.checkpoint.draft_vocab is None:
            raise ValueError("draft_head needs a checkpoint with a token ranking: convert it with "
                             "qspec-convert --draft-vocab CALIBRATION.jsonl")
    if gamma != "auto" and (not is_integer(gamma) or not 1 <= gamma <= MAX_GAMMA):
        raise ValueError(f"gamma must be 'auto' or an integer in [1, {MAX_GAMMA}], got {gamma!r}")
    if not is_integer(seed) or not -2**63 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
    if max_len is not None and (not is_integer(max_len) or max_len < 1):
        raise ValueError(f"max_len must be an integer >= 1 or None, got {max_len!r}")
    dtype = default_dtype() if dtype is None else dtype
    try:
        known = jnp.dtype(dtype) in COMPUTE_DTYPES
    except TypeError:
        known = False
    if not known:
        raise ValueError(f"dtype must be one of {[d.name for d in COMPUTE_DTYPES]}, got {dtype!r}")
    sharding.check(model.config, tensor_parallel, model.checkpoint.online_rotation_seed, model.checkpoint.params)
    if (ar is None or ar.quantized) and not model.checkpoint.quantized:
        raise ValueError(f"method {method!r} needs a quantized checkpoint; this one holds float weights")
    if kernels == "pallas" and jax.default_backend() != "gpu":  # (lowering for CUDA from a CPU host stays possible)
        raise ValueError(f"kernels='pallas' needs a GPU, and JAX runs on {jax.default_backend()!r} here: use "
                         "'reference' (the jnp references), 'interpret' (the Pallas kernels, interpreted: slow) "
                         "or 'auto'")
    execution = Execution.decode(kernels)
    stop = _stop_strings(model, stop)
    if not isinstance(return_logprobs, bool):
        raise ValueError(f"return_logprobs must be True or False, got {return_logprobs!r}")
    # settings checked before the prompts; a list's length against the prompts after them
    lists = {n: len(v) for n, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                                    ("top_k", top_k), ("top_p", top_p)) if isinstance(v, (list, tuple, np.ndarray))}
    budgets = per_row(max_new_tokens, lists.get("max_new_tokens"), "max_new_tokens")
    if not budgets or not all(is_integer(n) and n >= 0 for n in budgets):
        raise ValueError(f"max_new_tokens must be an integer >= 0 (or a list of them, one per prompt), "
                         f"got {max_new_tokens!r}")
    rows = max((v for n, v in lists.items() if n != "max_new_tokens"), default=None)
    sampling = Sampling.of(temperature, top_k, top_p, rows)
    ids = tokenize(model, prompts, chat, system)
    tokens, lengths = pad_prompts(ids, PROMPT_MULTIPLE)
    b = len(ids)
    for name, n in lists.items():
        if n != b:
            raise ValueError(f"{name} as a list gives one value per prompt: {b} expected, got {n}")
    budgets = np.asarray([int(n) for n in budgets] * (1 if lists.get("max_new_tokens") else b), object)
    max_new_tokens = int(budgets.max())  # (checked against max_len before any cast)
    cfg = model.config
    if max_len is None:
        max_len = cfg.max_position_embeddings
    elif max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len={max_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings} (the positions it was trained for)")
    if np.any(over := lengths + budgets > max_len):
        i = int(np.argmax(over))
        raise ValueError(f"a prompt of {lengths[i]} token{'s' if lengths[i] != 1 else ''} plus "
                         f"max_new_tokens={budgets[i]} exceeds the cache length max_len={max_len}")
    budgets = budgets.astype(np.int32)
    eos_ids = _eos_ids(model, eos_token_id)
    if max_new_tokens == 0:
        yield StreamUpdate([np.zeros(0, np.int32)] * b, [""] * b if model.tokenizer is not None else None, [True] * b,
                           GenerationResult([np.zeros(0, np.int32)] * b, lengths, np.zeros(b, np.int32),
                                            ["length"] * b, [""] * b if model.tokenizer is not None else None,
                                            _stats(None, 0.0, ar is None),
                                            [np.zeros(0, np.float32)] * b if return_logprobs else None))
        return

    head = draft_head is not None or draft_head_bits != 16  # the drafts read a copy of the head
    rt = Runtime(cfg, eos_ids, not sampling.greedy, dtype, model.checkpoint.online_rotation_seed, execution,
                 draft_kv=draft_kv, draft_window=window, draft_head=head, logprobs=return_logprobs)
    params = model.decode_params((draft_head, draft_head_bits) if head else None, tensor_parallel)
    if ar is not None:
        decoder = Decoder(rt, ar, tensor_parallel=tensor_parallel)
    elif gamma == "auto":
        costs = cost_model(model.decode_params((draft_head, draft_head_bits) if head else None), cfg, dtype,
                           draft_kv, window)
        decoder = Decoder(rt, None, draft, None, costs, tensor_parallel)
    else:
        decoder = Decoder(rt, None, draft, int(gamma), tensor_parallel=tensor_parallel)
    room = -(-max_new_tokens // NEW_TOKENS_MULTIPLE) * NEW_TOKENS_MULTIPLE
    start = time.perf_counter()
    state = init_state(decoder, jnp.asarray(tokens), jnp.asarray(lengths), seed_key(int(seed)),
                       max_new_tokens=jnp.asarray(budgets), buffer_len=buffer_length(tokens.shape[1], room),
                       temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    state = prefill_jit(params, decoder, state)
    loop = functools.partial(decode_jit, params, decoder)
    rounds = None if chunk_rounds is None else jnp.asarray(chunk_rounds, jnp.int32)
    tok = model.tokenizer
    if stop:
        from qspec_jax.tokenizer import cut_at_stop
    shown = [0] * b  # tokens and characters of text already yielded per sequence
    shown_text = [0] * b
    cuts: dict[int, tuple] = {}  # sequence -> (tokens, text) cut at a stop string
    hold = max((len(x) for x in stop), default=1) - 1  # text that may begin a stop string is held back
    while True:
        if chunk_rounds is not None or not bool(jnp.all(state.done)):
            state = loop(state, rounds)
        done = np.asarray(jax.device_get(state.done))
        toks, lens = jax.device_get((state.tokens, state.lengths))
        seqs = [toks[i, lengths[i]:lens[i]] for i in range(b)]
        for i in range(b):
            if stop and i not in cuts and (cut := cut_at_stop(tok, seqs[i], stop)) is not None:
                cuts[i] = cut
        if cuts:  # a sequence cut at a stop string stops decoding
            state = dataclasses.replace(state, finish=state.finish.at[jnp.asarray(list(cuts))].set(STOP))
            done = done | np.isin(np.arange(b), list(cuts))
        seqs = [cuts[i][0] if i in cuts else s for i, s in enumerate(seqs)]
        texts = None
        if tok is not None:
            full = [cuts[i][1] if i in cuts else tok.decode(s, skip_special_tokens=True) for i, s in enumerate(seqs)]
            ready = [len(t) if done[i] else max(shown_text[i], len(t) - hold - (t.endswith("\ufffd")))
                     for i, t in enumerate(full)]
            texts = [full[i][shown_text[i]:ready[i]] for i in range(b)]
            shown_text = ready
        update = StreamUpdate([s[shown[i]:] for i, s in enumerate(seqs)], texts, done.tolist())
        shown = [len(s) for s in seqs]
        if done.all():
            break
        yield update
    wall = time.perf_counter() - start
    out = jax.device_get((state.finish, state.rounds, state.drafted, state.accepted, state.logprobs))
    finish, n_rounds, drafted, accepted, lp = out
    gen = np.array([len(x) for x in seqs], np.int32)
    reasons = [FINISH_REASONS[int(f)] for f in finish]
    stats = _stats((n_rounds, drafted, accepted, lens - lengths), wall, ar is None)
    if decoder.costs is not None:
        stats["best_gain"] = decoder.costs.best_gain(AUTO_GAMMA_MAX, b, state.tokens.shape[1])
    logprobs = [lp[i, lengths[i]:lengths[i] + gen[i]] for i in range(b)] if return_logprobs else None
    final = None if tok is None else full
    yield dataclasses.replace(update, result=GenerationResult(seqs, lengths, gen, reasons, final, stats, logprobs))


def _stop_strings(model: Model, stop) -> tuple[str, ...]:
    """``generate``'s ``stop`` as a tuple of non-empty strings (a tokenizer needed to find them)."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else None
    if not stops or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a non-empty list of them, got {stop!r}")
    if model.tokenizer is None:
        raise ValueError("stop strings are found in the decoded text: this checkpoint has no tokenizer")
    return stops


def _eos_ids(model: Model, eos_token_id) -> tuple[int, ...]:
    """The stop tokens: the given id(s) (``-1``: none), else the tokenizer's and the config's EOS ids."""
    vocab = model.config.vocab_size
    if eos_token_id is None:
        tok_eos = getattr(model.tokenizer, "eos_token_id", None)
        ids, source = (*(() if tok_eos is None else (tok_eos,)), *model.config.eos_ids), "the tokenizer's / config's"
    elif is_integer(eos_token_id) and eos_token_id == -1:
        return ()
    elif is_integer(eos_token_id) or (isinstance(eos_token_id, (list, tuple)) and eos_token_id):
        ids, source = tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,), "the given"
    else:
        raise ValueError(f"eos_token_id must be a token id, a non-empty list of them, -1 or None, got {eos_token_id!r}")
    for i in ids:
        if not is_integer(i) or not 0 <= i < vocab:
            raise ValueError(f"{source} eos_token_id must be token ids in [0, {vocab}) (or -1: never stop on a "
                             f"token), got {ids if eos_token_id is None else eos_token_id!r}")
    return tuple(dict.fromkeys(int(i) for i in ids))


def _stats(counters, wall: float, qspec: bool) -> dict[str, float]:
    """Totals over the batch (:class:`GenerationResult`'s ``stats``). ``accepted`` counts the drafts
    committed: a round cut short by ``max_new_tokens`` or EOS counts all its ``gamma`` drafts as
    drafted but commits fewer, so short runs understate the acceptance rate."""
    rounds, drafted, accepted, gen = (0, 0, 0, 0) if counters is None else (int(np.sum(c)) for c in counters)
    common = dict(generated=gen, wall_time_s=wall, tokens_per_s=gen / wall if wall > 0 else 0.0)
    if not qspec:
        return dict(steps=rounds, **common)
    # the first token of each sequence comes from the prefill, not from a round
    in_rounds = 0 if counters is None else gen - int(np.sum(np.minimum(counters[3], 1)))
    return dict(rounds=rounds, drafted=drafted, accepted=accepted,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                tokens_per_round=in_rounds / rounds if rounds else 0.0, **common)
