"""``qspec-convert SRC OUT``: HF safetensors directory or GGUF file -> qspec-jax checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from convert.learn_rotation import LearnOptions
from convert.quantize import METHODS, QuantScheme


ROTATIONS = ("hadamard", "learned")
LEARN_FLAGS = {"steps": "--rotation-steps", "lr": "--rotation-lr", "n_samples": "--rotation-samples",
               "seq_len": "--rotation-seq-len", "batch": "--rotation-batch"}
GROUP_DEFAULT = object()  # --group-size not given (told apart from an explicit 32)



def _rotation(value: str) -> str:
    """``--rotate``'s kind; a path there means the flag came before SRC OUT without a kind."""
    if value not in ROTATIONS:
        raise argparse.ArgumentTypeError(
            f"invalid choice {value!r} (choose from {', '.join(ROTATIONS)}); a bare --rotate goes after SRC OUT, "
            "or name its kind: --rotate hadamard SRC OUT")
    return value

def _group(value: str) -> int | None:
    if value in ("channel", "per-channel", "0"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"group size must be an integer or 'channel', got {value!r}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qspec-convert", description=__doc__)
    ap.add_argument("src", type=Path, help="HF checkpoint directory (config.json + safetensors) or .gguf file")
    ap.add_argument("out", type=Path, help="output checkpoint directory")
    ap.add_argument("--quant", choices=(*METHODS, "none"), default="rtn",
                    help="rtn (round to nearest), gptq (calibrated), none (keep float weights)")
    ap.add_argument("--group-size", type=_group, default=GROUP_DEFAULT, help="32 (default), 64, 128, ... or 'channel'")
    sym = ap.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", help="s*q, q in [-8, 7]")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false", help="s*u + m (GGUF Q4_1), the default")
    ap.set_defaults(symmetric=None)
    ap.add_argument("--rotate", nargs="?", const="hadamard", type=_rotation, metavar="{" + ",".join(ROTATIONS) + "}",
                    help="fold a QuaRot-style rotation into the weights: a randomized Hadamard (the default), or one "
                         "learned from it on --calibration data")
    ap.add_argument("--seed", type=int, help="rotation seed (default 0; with --rotate)")
    ap.add_argument("--calibration", type=Path,
                    help="GSM8K-style JSONL for GPTQ and --rotate learned (e.g. ../shared/data/gsm8k_train.jsonl)")
    defaults = LearnOptions()
    learn = ap.add_argument_group("learned rotation (with --rotate learned)")
    learn.add_argument("--rotation-steps", type=int, help=f"optimizer steps (default {defaults.steps})")
    learn.add_argument("--rotation-lr", type=float, help=f"learning rate: a step's length before momentum (default {defaults.lr})")
    learn.add_argument("--rotation-samples", type=int,
                       help=f"calibration sequences (default {defaults.n_samples})")
    learn.add_argument("--rotation-seq-len", type=int, help=f"tokens per sequence (default {defaults.seq_len})")
    learn.add_argument("--rotation-batch", type=int, help=f"sequences per step (default {defaults.batch})")
    ap.add_argument("--n-samples", type=int, help="GPTQ calibration sequences (default 64)")
    ap.add_argument("--seq-len", type=int, help="GPTQ calibration sequence length (default 512)")
    ap.add_argument("--draft-vocab", type=Path, metavar="JSONL",
                    help="GSM8K-style JSONL whose token frequencies rank the rows of draft heads (generate's draft_head)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from convert.pipeline import convert

    ap = parser()
    args = ap.parse_args(argv)
    if args.quant == "none" and (args.group_size is not GROUP_DEFAULT or args.symmetric is not None):
        ap.error("--group-size / --symmetric / --asymmetric set how weights are quantized: not with --quant none")
    if args.seed is not None and not args.rotate:
        ap.error("--seed seeds the rotation: it needs --rotate")
    learned = args.rotate == "learned"
    gptq = {k: v for k, v in (("calibration", args.calibration), ("n_samples", args.n_samples),
                              ("seq_len", args.seq_len)) if v is not None}
    if (args.n_samples, args.seq_len) != (None, None) and args.quant != "gptq":
        ap.error("--n-samples / --seq-len calibrate GPTQ: they need --quant gptq")
    if args.calibration is not None and args.quant != "gptq" and not learned:
        ap.error("--calibration feeds GPTQ and learned rotations, which need --quant gptq or --rotate learned")
    options = {k: getattr(args, flag[2:].replace("-", "_")) for k, flag in LEARN_FLAGS.items()}
    if not learned and any(v is not None for v in options.values()):
        ap.error(f"{' / '.join(LEARN_FLAGS.values())} set how a rotation is learned: they need --rotate learned")
    try:
        group = 32 if args.group_size is GROUP_DEFAULT else args.group_size
        scheme = None if args.quant == "none" else QuantScheme(group, bool(args.symmetric), args.quant)
        learn = LearnOptions(**{k: v for k, v in options.items() if v is not None}) if learned else None
        out = convert(args.src, args.out, scheme, (args.seed or 0) if args.rotate else None, **gptq,
                      draft_vocab=args.draft_vocab, learned=learn)
    except (ValueError, FileNotFoundError) as e:
        print(f"qspec-convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
