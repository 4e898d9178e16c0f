"""qspec-jax: `generate` (prompts from the command line, a file or stdin, any method; text or JSON
lines out) and `demo` (QSPEC next to W4A16 on the embedded SmolLM2, the README's first command). Converting a checkpoint is `qspec-convert`. It lives in ``convert``
(not ``qspec_jax``) because its default model is the embedded SmolLM2, converted on first use."""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata
from pathlib import Path

import jax
import numpy as np

from convert.embedded import default_checkpoint

DEMO_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a haiku about the sea.",
]


def _print_stats(label: str, stats: dict, file=None) -> None:
    rounds = (f"rounds {stats['rounds']}, acceptance {stats['acceptance_rate']:.3f}, "
              f"tokens/round {stats['tokens_per_round']:.2f}" if "rounds" in stats else f"steps {stats['steps']}")
    print(f"  [{label}] {stats['generated']} tokens in {stats['wall_time_s']:.2f} s "
          f"({stats['tokens_per_s']:.1f} tok/s) | {rounds}", file=file)


def _eos(text: str) -> int | list[int]:
    """``--eos``: a token id, comma-separated ids, or -1 (never stop on a token)."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas, or -1; got {text!r}") from None
    return ids[0] if len(ids) == 1 else ids


def read_prompts(args) -> list:
    """The prompts: ``--prompt`` (repeatable), else ``--input`` (a file, ``-`` for stdin): one prompt per
    line, or with ``--jsonl`` (default for a ``.jsonl`` file) one JSON object per line, ``{"prompt": str}``
    or ``{"messages": [{"role", "content"}, ...]}``. Blank lines are skipped."""
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give prompts with --prompt (repeatable) or --input FILE ('-': stdin), not both")
    if args.prompt is not None:
        return list(args.prompt)
    text = sys.stdin.read() if str(args.input) == "-" else Path(args.input).expanduser().read_text()
    jsonl = args.jsonl or Path(args.input).suffix == ".jsonl"
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.input} line {n}: not JSON ({e})") from None
        if not isinstance(row, dict) or len({"prompt", "messages"} & set(row)) != 1:
            raise ValueError(f"{args.input} line {n}: expected an object with 'prompt' (a string) or 'messages'")
        prompts.append(row.get("prompt", row.get("messages")))
    if not prompts:
        raise ValueError(f"{args.input}: no prompts")
    return prompts


def _int_or(word: str):
    """An argparse type: ``word`` or an integer (generate() checks its range)."""
    def parse(text: str) -> int | str:
        if text == word:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {word!r} or an integer, got {text!r}") from None
    return parse


def _checkpoint(args) -> Path:
    """``--checkpoint``, else the embedded SmolLM2's (converted on first use)."""
    return default_checkpoint() if args.checkpoint is None else args.checkpoint


def cmd_generate(args) -> None:
    from qspec_jax.api import generate, load

    qspec_only = {"gamma": args.gamma, "draft": args.draft, "draft_kv": args.draft_kv,
                  "draft_window": args.draft_window, "draft_sinks": args.draft_sinks, "draft_head": args.draft_head,
                  "draft_head_bits": args.draft_head_bits}
    qspec_only = {name: value for name, value in qspec_only.items() if value is not None}  # unset: generate()'s defaults
    if qspec_only.get("draft_window") == "none":
        qspec_only["draft_window"] = None
    if args.method != "qspec" and qspec_only:  # refused, not silently ignored
        flags = ", ".join("--" + name.replace("_", "-") for name in qspec_only)
        raise ValueError(f"{flags} {'applies' if len(qspec_only) == 1 else 'apply'} to --method qspec only, "
                         f"not {args.method}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.logprobs and not args.json:
        raise ValueError("--logprobs goes with --json (the log-probabilities are printed in the JSON lines)")
    prompts = read_prompts(args)
    model = load(_checkpoint(args))
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        kw = dict(max_new_tokens=args.max_new_tokens, method=args.method, **qspec_only, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, chat=args.chat, system=args.system,
                  stop=args.stop, eos_token_id=args.eos, max_len=args.max_len, dtype=args.dtype,
                  return_logprobs=args.logprobs, tensor_parallel=args.tensor_parallel)
        # one prompt in text mode: its text is printed as rounds commit it
        live = not args.no_stream and not args.json and len(batch) == 1
        res = generate(model, batch, **kw) if args.no_stream else _streamed(model, batch, kw, live)
        for i, seq in enumerate(res.sequences):
            text = res.texts[i] if res.texts is not None else None
            if args.json:
                row = {"index": start + i, "text": text, "tokens": seq.tolist(),
                       "finish_reason": res.finish_reasons[i]}
                if res.logprobs is not None:
                    row["logprobs"] = res.logprobs[i].tolist()
                print(json.dumps(row), flush=True)
            else:
                print("" if live and text is not None else text if text is not None else seq.tolist(), flush=True)
                print(f"[finish: {res.finish_reasons[i]}]", file=sys.stderr)
        first = " (compilation included)" if start == 0 else ""
        _print_stats(f"{args.method}, prompts {start}-{start + len(res.sequences) - 1}{first}", res.stats,
                     file=sys.stderr)


def _streamed(model, batch: list, kw: dict, live: bool):
    """stream_generate's result; ``live``: the one prompt's text written to stdout as it arrives. On a
    terminal, stderr shows the tokens so far and their rate."""
    from qspec_jax.api import stream_generate

    t0, n = time.perf_counter(), 0
    for update in stream_generate(model, batch, **kw):
        n += sum(len(t) for t in update.tokens)
        if live and update.texts is not None:  # (a checkpoint without a tokenizer: its ids at the end)
            print(update.texts[0], end="", flush=True)
        if sys.stderr.isatty():
            print(f"\r[{n} tokens, {n / (time.perf_counter() - t0):.1f} tok/s]", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return update.result


DEMO_GAMMA = 3  # the demo shows QSPEC's rounds; generate()'s own default is 'auto'

def cmd_demo(args) -> None:
    from qspec_jax.api import generate, load

    model = load(_checkpoint(args))
    print(f"checkpoint: {model.checkpoint.path}")
    runs = {}
    for label, method, qspec in (("w4a16", "w4a16", {}),
                                 ("qspec/w4a4", "qspec", dict(draft="w4a4", gamma=args.gamma)),
                                 ("qspec/w4a8", "qspec", dict(draft="w4a8", gamma=args.gamma))):
        for attempt in ("compile", "timed"):  # the second call reuses the compiled loop
            runs[label] = generate(model, DEMO_PROMPTS, max_new_tokens=args.max_new_tokens, method=method,
                                   chat=True, **qspec)
    for i, prompt in enumerate(DEMO_PROMPTS):
        print(f"\nprompt: {prompt}\n{runs['qspec/w4a8'].texts[i].strip()}")
    print(f"\nbatch of {len(DEMO_PROMPTS)}, gamma={args.gamma}, greedy, second call (compiled):")
    if jax.default_backend() != "gpu":  # the CPU runs the jnp references: its speeds are not the GPU's
        print(f"  (timed on the {jax.default_backend().upper()}: these speeds say nothing about a GPU)")
    ref = runs["w4a16"]
    for label, res in runs.items():
        same = all(np.array_equal(a, b) for a, b in zip(res.sequences, ref.sequences))
        _print_stats(label + ("" if label == "w4a16" else f", identical to w4a16: {same}"), res.stats)


def main(argv: list[str] | None = None) -> int:
    from qspec_jax.api import DEFAULT_DRAFT, DEFAULT_GAMMA, DEFAULT_SINKS, DEFAULT_WINDOW, DRAFTS, METHODS

    fmt = argparse.ArgumentDefaultsHelpFormatter
    ap = argparse.ArgumentParser(prog="qspec-jax", description=__doc__, formatter_class=fmt)
    ap.add_argument("--version", action="version", version=f"%(prog)s {metadata.version('qspec-jax')}")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, text in (("generate", "decode one prompt"), ("demo", "QSPEC next to W4A16 on two chat prompts")):
        p = sub.add_parser(name, help=text, description=text, formatter_class=fmt)
        p.add_argument("--checkpoint", type=Path, default=None, help="converted checkpoint (none: the embedded SmolLM2)")
        p.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate at most")
    sub.choices["demo"].add_argument("--gamma", type=_int_or("auto"), default=DEMO_GAMMA,
                                     help="drafted tokens per round, or 'auto' (which drafts nothing while a draft "
                                          "step reads as many bytes as a W4A16 step: below the draft window's length)")
    g = sub.choices["generate"]
    g.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for a batch)")
    g.add_argument("--input", default=None, help="a file of prompts, one per line ('-': stdin)")
    g.add_argument("--jsonl", action="store_true",
                   help="--input lines are JSON objects: {\"prompt\": str} or {\"messages\": [...]} "
                        "(the default for a .jsonl file)")
    g.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (index, text, tokens, finish_reason[, logprobs])")
    g.add_argument("--method", choices=METHODS, default="qspec", help="qspec, or an autoregressive baseline")
    g.add_argument("--gamma", type=_int_or("auto"), default=None,
                   help=f"qspec: drafted tokens per round, or 'auto' (none: {DEFAULT_GAMMA})")
    g.add_argument("--draft", choices=DRAFTS, default=None,
                   help=f"qspec: the drafts' activation precision (none: {DEFAULT_DRAFT})")
    g.add_argument("--draft-kv", type=int, choices=(8, 4), default=None,
                   help="qspec: the drafts read an INT8 / INT4 copy of the KV cache")
    g.add_argument("--draft-window", type=_int_or("none"), default=None,
                   help="qspec: the drafts attend over the first --draft-sinks slots and the last this many only; "
                        f"'none': the whole cache (none given: {DEFAULT_WINDOW})")
    g.add_argument("--draft-sinks", type=int, default=None,
                   help=f"qspec, with --draft-window: slots always seen (none: {DEFAULT_SINKS})")
    g.add_argument("--draft-head", type=int, default=None,
                   help="qspec: the drafts' logits over this many most frequent tokens only (a checkpoint "
                        "converted with --draft-vocab)")
    g.add_argument("--draft-head-bits", type=int, choices=(16, 4), default=None,
                   help="qspec: 4 makes the drafts read an INT4 copy of the head (of --draft-head's rows, or "
                        "of the whole head); none: 16, the float head")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=None, help="with a temperature > 0")
    g.add_argument("--top-p", type=float, default=None, help="with a temperature > 0")
    g.add_argument("--seed", type=int, default=0, help="sampling key")
    g.add_argument("--chat", action="store_true", help="wrap the prompts in the chat template")
    g.add_argument("--system", default=None, help="with --chat: a system message first")
    g.add_argument("--stop", action="append", default=None, help="a string that ends the text (repeatable)")
    g.add_argument("--eos", type=_eos, default=None,
                   help="token ids that end a sequence, comma-separated, or -1 for none (none: the model's)")
    g.add_argument("--max-len", type=int, default=None, help="prompt + new tokens at most (none: the model's)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activations and KV cache (none: bfloat16 on a GPU, float32 elsewhere)")
    g.add_argument("--logprobs", action="store_true", help="with --json: each token's log-probability")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over the first N devices (heads, MLP features, vocabulary, KV cache)")
    g.add_argument("--no-stream", action="store_true",
                   help="print each batch once it is done (without it, a single prompt's text is printed as "
                        "it is generated, and on a terminal stderr shows the tokens/s as it goes)")
    args = ap.parse_args(argv)
    try:
        {"generate": cmd_generate, "demo": cmd_demo}[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"qspec-jax: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
