"""``qspec-jax``: the command-line entry point (``demo`` runs the embedded SmolLM2 in every mode)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

DEMO_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " \
              "How many clips did Natalia sell altogether in April and May?"
DEMO_PARAGRAPH = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
                  "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
                  "from 1887 to 1889. Locally nicknamed \"La dame de fer\", it was constructed as the centrepiece "
                  "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution.")


def default_checkpoint() -> Path:
    """The embedded SmolLM2 converted with the default scheme (converted on first use)."""
    from convert.pipeline import convert
    from convert.quantize import QuantScheme
    from qspec_jax.embedded import cache_dir, embedded_gguf

    out = cache_dir() / "smollm2-rtn-asym-g32"
    if not (out / "manifest.json").is_file():
        print(f"converting the embedded SmolLM2 into {out} ...", flush=True)
        convert(embedded_gguf(), out, QuantScheme(32, False, "rtn"), None)
    return out


def demo(checkpoint: Path | None, max_new_tokens: int) -> None:
    from qspec_jax.checkpoint import load_checkpoint
    from qspec_jax.decode import greedy_generate
    from qspec_jax.evaluate import perplexity
    from qspec_jax.linear import MODES
    from qspec_jax.tokenizer import chat_prompt, load_tokenizer

    path = checkpoint or default_checkpoint()
    ck = load_checkpoint(path)
    tok = load_tokenizer(path)
    prompt = chat_prompt(tok, DEMO_PROMPT)
    para = np.asarray(tok.encode(DEMO_PARAGRAPH, add_special_tokens=False), np.int32)
    print(f"checkpoint: {path}\nprompt: {DEMO_PROMPT}\n")
    for mode in MODES:
        t = time.time()
        out = greedy_generate(ck.params, ck.config, [prompt], max_new_tokens, mode=mode, eos_id=tok.eos_token_id,
                              online_rotation_seed=ck.online_rotation_seed)[0]
        ppl = perplexity(ck.params, ck.config, para, window=len(para), mode=mode,
                         online_rotation_seed=ck.online_rotation_seed)
        text = tok.decode(out, skip_special_tokens=True).strip().replace("\n", " ")
        print(f"[{mode}] paragraph ppl {ppl:.2f} | {len(out)} tokens, {time.time() - t:.1f} s (incl. compile)\n  {text}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="qspec-jax", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="greedy continuation and paragraph perplexity in every mode")
    d.add_argument("--checkpoint", type=Path, default=None, help="converted checkpoint (default: embedded SmolLM2)")
    d.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    try:
        if args.command == "demo":
            demo(args.checkpoint, args.max_new_tokens)
    except (ValueError, FileNotFoundError) as e:
        print(f"qspec-jax: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
