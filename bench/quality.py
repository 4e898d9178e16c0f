"""Quality of the weight schemes on SmolLM2: WikiText-2 perplexity per mode and the teacher-forced
draft/verifier agreement on GSM8K (the paper's Figure 2), with simulated tokens per QSPEC round.

    python -m bench.quality --wikitext ../shared/data/wikitext2_test.raw \
        --gsm8k ../shared/data/gsm8k_test_dev.jsonl --calibration ../shared/data/gsm8k_train.jsonl

Checkpoints: each ``--methods`` entry (RTN, GPTQ) times each ``--rotations`` entry (none, a randomized
Hadamard, a learned R1). The learned R1 is trained once (on the calibration data, with the
``--rotation-*`` options) and folded into every learned checkpoint; a checkpoint's conversion time
includes that training.

Perplexity windowing: the raw file (CRLF -> LF) is tokenized as one string; the first
``--ppl-tokens`` tokens are cut into non-overlapping windows of ``--window`` tokens, each scored
from its own start (no context carried across windows). Agreement: W4A16 answers the first
``--answers`` dev questions greedily (chat template, up to ``--max-answer-tokens``); along each
answer after its first token (which the W4A16 prefill commits), the W4A4 / W4A8 top-1 next token is
compared with W4A16's (teacher-forced, same weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from convert.learn_rotation import LearnedRotation, LearnOptions
from convert.pipeline import convert
from convert.quantize import QuantScheme
from pallas_kernels.precision import W16A16, parse_precision
from qspec_jax.checkpoint import Checkpoint, load_checkpoint
from qspec_jax.decode import pad_prompts
from qspec_jax.api import Model, generate
from convert.embedded import cache_dir, embedded_gguf
from qspec_jax.evaluate import perplexity, token_scores, simulate_rounds
from qspec_jax.tokenizer import chat_prompt, load_tokenizer
from bench.args import command_line, git_commit, utc_now

GAMMAS = range(1, 7)
CAVEAT = ("Notes: the W4A4 draft is unusable without rotation (alpha 0.11: per-token INT4 activations cannot hold SmolLM2's outlier channels); rotation makes it usable but forces re-rounding the GGUF's 4-bit weights, which costs the verifier (RTN +49% W4A16 perplexity, GPTQ +10%). GPTQ without rotation reproduces the Q4_1 codes exactly (the weights already lie on that grid), so that row is the passthrough checkpoint again. Alpha is measured along each checkpoint's own W4A16 answers, so a weaker verifier (rtn-rot) is scored on its own, more repetitive, text, which flatters its alpha.")
DRAFTS = ("w4a4", "w4a8")
ROTATIONS = {"none": "norot", "hadamard": "hadamard", "learned": "learned"}  # --rotations entry: name suffix


def wikitext_ids(path: Path, tokenizer, n_tokens: int) -> np.ndarray:
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    text = Path(path).read_text(encoding="utf-8").replace("\r\n", "\n")
    ids = np.asarray(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
    if len(ids) < n_tokens:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return ids[:n_tokens]


def agreement(ck: Checkpoint, prompts: list[list[int]], answers: list[list[int]]) -> dict:
    """Teacher-forced top-1 agreement of each draft mode with W4A16 along the W4A16 answers, at the
    positions QSPEC's rounds commit: an answer's first token comes from the W4A16 prefill, so the
    rounds (and alpha) start at its second token."""
    seqs = [p + a for p, a in zip(prompts, answers)]
    tokens, _ = pad_prompts(seqs)
    kw = dict(online_rotation_seed=ck.online_rotation_seed)
    tops = {m: np.concatenate([token_scores(ck.params, ck.config, tokens[i:i + 10], precision=parse_precision(m),
                                            **kw)[1]
                               for i in range(0, len(tokens), 10)]) for m in ("w4a16", *DRAFTS)}
    out = {}
    for draft in DRAFTS:
        # position t predicts token t + 1: len(p) .. len(p) + len(a) - 2 predict the answer's tokens 1..
        agree = [tops[draft][i, len(p): len(p) + len(a) - 1] == tops["w4a16"][i, len(p): len(p) + len(a) - 1]
                 for i, (p, a) in enumerate(zip(prompts, answers))]
        flat = np.concatenate(agree)
        tpr = {g: flat.size / sum(simulate_rounds(a, g) for a in agree) for g in GAMMAS}
        out[draft] = {"alpha": float(flat.mean()), "tokens": int(flat.size), "tokens_per_round": tpr}
    return out


def evaluate_checkpoint(ck: Checkpoint, tok, wiki: np.ndarray, window: int, questions: list[str],
                        max_answer_tokens: int, modes: tuple[str, ...]) -> dict:
    kw = dict(online_rotation_seed=ck.online_rotation_seed)
    res: dict = {"ppl": {}}
    for mode in modes:
        t = time.time()
        res["ppl"][mode] = perplexity(ck.params, ck.config, wiki, window=window, precision=parse_precision(mode), **kw)
        print(f"  ppl {mode}: {res['ppl'][mode]:.3f} ({time.time() - t:.0f} s)", flush=True)
    if questions:
        t = time.time()
        prompts = [chat_prompt(tok, q) for q in questions]
        answers = []
        for i in range(0, len(prompts), 25):
            res_i = generate(Model(ck, tok), prompts[i:i + 25], max_new_tokens=max_answer_tokens, method="w4a16")
            answers += [s.tolist() for s in res_i.sequences]
        res["agreement"] = agreement(ck, prompts, answers)
        res["answer_tokens"] = int(sum(len(a) for a in answers))
        print(f"  agreement: { {d: round(v['alpha'], 4) for d, v in res['agreement'].items()} } "
              f"({time.time() - t:.0f} s)", flush=True)
    return res


def recommend(results: dict) -> tuple[str, str, str]:
    """Verifier quality first (W4A16 ppl within 5% of the best), then tokens per round at gamma=3."""
    best_ppl = min(r["ppl"]["w4a16"] for r in results.values())
    ok = {n: r for n, r in results.items() if r["ppl"]["w4a16"] <= 1.05 * best_ppl and "agreement" in r}
    name, draft = max(((n, d) for n in ok for d in DRAFTS),
                      key=lambda nd: ok[nd[0]]["agreement"][nd[1]]["tokens_per_round"][3])
    r = ok[name]
    why = (f"W4A16 perplexity {r['ppl']['w4a16']:.2f} is within 5% of the best W4A16 perplexity "
           f"({best_ppl:.2f}), and among such checkpoints its {draft} draft has the highest simulated "
           f"tokens per round at gamma=3 ({r['agreement'][draft]['tokens_per_round'][3]:.2f}, "
           f"alpha={r['agreement'][draft]['alpha']:.3f}).")
    return name, draft, why


def file_identity(path: Path | None) -> dict | None:
    """A file by its resolved path, size and modification time: another file, or this one changed, differs."""
    if path is None:
        return None
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def evaluation_settings(src: Path, args: argparse.Namespace) -> dict:
    """What the numbers depend on besides a checkpoint's weights: a resumed run must have the same."""
    return {"source": file_identity(src), "wikitext": file_identity(args.wikitext), "ppl_tokens": args.ppl_tokens,
            "window": args.window, "gsm8k": file_identity(args.gsm8k), "answers": args.answers if args.gsm8k else None,
            "max_answer_tokens": args.max_answer_tokens if args.gsm8k else None}


def converter_code() -> str:
    """A digest of the code a conversion runs (``convert``, ``qspec_jax``, ``pallas_kernels``): a
    checkpoint cached by older code is converted again rather than reused."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for f in sorted(p for pkg in ("convert", "qspec_jax", "pallas_kernels") for p in (root / pkg).rglob("*.py")):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def converted(work: Path, name: str, src: Path, scheme: QuantScheme | None, rotation_seed: int | None,
              args: argparse.Namespace, learned: LearnOptions | LearnedRotation | None = None) -> tuple[Path, float]:
    """``(directory, conversion seconds)`` of checkpoint ``name`` converted from ``src``, cached under
    ``work`` in a directory per distinct conversion (converter code, source file, scheme, rotation, GPTQ
    calibration, learned-rotation options): a run with other settings or code converts anew. A reused
    learned R1's training time counts in the seconds."""
    gptq = scheme is not None and scheme.method == "gptq"
    options = learned if isinstance(learned, LearnOptions) or learned is None else LearnOptions(
        **{k: learned.record[k] for k in ("steps", "lr", "n_samples", "seq_len", "batch")})
    conversion = {"code": converter_code(), "source": file_identity(src),
                  "scheme": None if scheme is None else dataclasses.asdict(scheme), "rotation_seed": rotation_seed,
                  "calibration": [file_identity(args.calibration), args.n_samples, args.seq_len] if gptq else None}
    if options is not None:
        conversion["learned"] = [dataclasses.asdict(options), file_identity(args.calibration)]
    out = work / f"{name}-{hashlib.sha256(json.dumps(conversion, sort_keys=True).encode()).hexdigest()[:12]}"
    timing = out.with_name(out.name + ".seconds")
    if not (out / "manifest.json").is_file() or not timing.is_file():
        print(f"converting {name} into {out}", flush=True)
        start = time.time()
        convert(src, out, scheme, rotation_seed, args.calibration, args.n_samples, args.seq_len, learned=learned)
        reused = learned.record["seconds"] if isinstance(learned, LearnedRotation) else 0.0
        timing.write_text(f"{time.time() - start + reused:.1f}\n")
    return out, float(timing.read_text())


def loss_curve(loss: list[float], chunks: int = 10) -> str:
    """The mean training loss over ``chunks`` equal runs of steps: ``"1.234 (steps 1-10), ..."``."""
    edges = np.linspace(0, len(loss), min(chunks, len(loss)) + 1).astype(int)
    return ", ".join(f"{np.mean(loss[a:b]):.3f} (steps {a + 1}-{b})" for a, b in zip(edges[:-1], edges[1:]))


def machine() -> str:
    """The device a run computes on: the accelerator's name, or the CPU's model and core count."""
    import jax

    dev = jax.devices()[0]
    if dev.platform != "cpu":
        return dev.device_kind
    cpuinfo = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if ln.startswith("model name")]
    return f"CPU: {names[0] if names else platform.processor() or 'unknown'}, {os.cpu_count()} cores"


def write_report(path: Path, results: dict, float_ppl: float, args: argparse.Namespace, settings: dict,
                 command: str) -> None:
    run = {"command": command, "device": machine(), "date": utc_now()[:10], "commit": git_commit()}
    lines = ["# SmolLM2-135M-Instruct: weight schemes, perplexity and draft agreement", "",
             f"Made by `{command}` on {run['device']}, {run['date']}, at commit {run['commit']}.", "",
             f"WikiText-2 test, first {args.ppl_tokens} tokens, non-overlapping windows of {args.window} "
             "tokens each scored from its own start. Checkpoints converted from the GGUF (Q4_1) by "
             f"`qspec-convert`; group size {args.group_size or 'per-channel'}, "
             f"{'symmetric' if args.symmetric else 'asymmetric'}; GPTQ calibrated on "
             f"{args.n_samples} x {args.seq_len} tokens of GSM8K train.", ""]
    lines += [f"W16A16 (the GGUF's weights dequantized to float32, no rotation): **ppl {float_ppl:.3f}**", "",
              "| checkpoint | W4A16 ppl | W4A8 ppl | W4A4 ppl | conversion s |", "|---|---|---|---|---|"]
    for name, r in results.items():
        same = f" (weights bitwise identical to {r['same_weights_as']})" if "same_weights_as" in r else ""
        lines.append(f"| {name}{same} | " + " | ".join(f"{r['ppl'][m]:.3f}" for m in ("w4a16", "w4a8", "w4a4"))
                     + f" | {r['conversion_s']:.0f} |")
    for name, r in results.items():
        if "learned" in r:
            rec = r["learned"]
            what = "R1 and the per-layer value-head R2" if rec.get("head_rotations") else "R1"
            lines += ["", f"Learned {what} (in `{name}`): {rec['steps']} steps of SGD with momentum on the normalized gradient (lr {rec['lr']}, cosine decay) on "
                      f"{rec['n_samples']} x {rec['seq_len']} calibration tokens, {rec['batch']} sequences a step, "
                      f"seed {rec['seed']}, {rec['seconds']:.0f} s; training loss KL(W16A16 || W4A4) + "
                      f"KL(W16A16 || W4A16), mean over runs of steps: {loss_curve(rec['loss'])}."]
            break
    if any("agreement" in r for r in results.values()):
        lines += ["", f"Teacher-forced top-1 agreement with W4A16 (alpha) along {args.answers} GSM8K-dev answers "
                  "generated greedily by W4A16 (from each answer's second token: the first is the prefill's), and "
                  "simulated tokens per round for gamma = 1..6:", "",
                  "| checkpoint | draft | alpha | " + " | ".join(f"g={g}" for g in GAMMAS) + " |",
                  "|---|---|---|" + "---|" * len(GAMMAS)]
        for name, r in results.items():
            for d, a in r.get("agreement", {}).items():
                lines.append(f"| {name} | {d} | {a['alpha']:.4f} | " +
                             " | ".join(f"{a['tokens_per_round'][g]:.2f}" for g in GAMMAS) + " |")
        name, draft, why = recommend(results)
        lines += ["", CAVEAT, "", f"**Recommended default for the embedded model: `{name}` with a {draft} draft.** {why}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"settings": settings, "float_ppl": float_ppl, "results": results,
                                                     **run}, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wikitext", type=Path, required=True)
    ap.add_argument("--gsm8k", type=Path, help="GSM8K dev JSONL for the agreement experiment")
    ap.add_argument("--calibration", type=Path, required=True, help="GSM8K train JSONL for GPTQ")
    ap.add_argument("--gguf", type=Path, default=None, help="source model (default: the embedded SmolLM2)")
    ap.add_argument("--workdir", type=Path, default=None, help="where converted checkpoints are kept")
    ap.add_argument("--ppl-tokens", type=int, default=40960)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--answers", type=int, default=100)
    ap.add_argument("--max-answer-tokens", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=32, help="0 = per channel")
    ap.add_argument("--symmetric", action="store_true")
    ap.add_argument("--n-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--rotations", default=",".join(ROTATIONS), help=f"among {', '.join(ROTATIONS)}")
    defaults = LearnOptions()
    ap.add_argument("--rotation-steps", type=int, default=defaults.steps, help="learned R1: optimizer steps")
    ap.add_argument("--rotation-lr", type=float, default=defaults.lr, help="learned R1: learning rate")
    ap.add_argument("--rotation-samples", type=int, default=defaults.n_samples, help="learned R1: sequences")
    ap.add_argument("--rotation-seq-len", type=int, default=defaults.seq_len, help="learned R1: tokens each")
    ap.add_argument("--rotation-batch", type=int, default=defaults.batch, help="learned R1: sequences a step")
    ap.add_argument("--out", type=Path, default=Path("bench/results/quality.md"))
    ap.add_argument("--resume", action="store_true", help="reuse results already in the --out JSON")
    args = ap.parse_args(argv)
    rotations = args.rotations.split(",")
    if unknown := set(rotations) - set(ROTATIONS):
        ap.error(f"--rotations: unknown {sorted(unknown)}; expected among {', '.join(ROTATIONS)}")
    try:
        learn: LearnOptions | LearnedRotation = LearnOptions(args.rotation_steps, args.rotation_lr,
                                                             args.rotation_samples, args.rotation_seq_len,
                                                             args.rotation_batch)
    except ValueError as e:
        ap.error(str(e))

    src = args.gguf or embedded_gguf()
    work = args.workdir or cache_dir() / "bench"
    questions = []
    if args.gsm8k:
        questions = [json.loads(line)["question"] for line in args.gsm8k.read_text().splitlines()
                     if line.strip()][: args.answers]
    settings = evaluation_settings(src, args)
    done: dict = {}
    float_ppl = None
    if args.resume and args.out.with_suffix(".json").is_file():
        earlier = json.loads(args.out.with_suffix(".json").read_text())
        if earlier.get("settings") != settings:
            raise SystemExit(f"--resume: {args.out.with_suffix('.json')} was measured with other settings "
                             f"({earlier.get('settings')}, now {settings}); run without --resume or with its settings")
        done, float_ppl = earlier["results"], earlier.get("float_ppl")
        for r in done.values():  # JSON turned the gamma keys into strings
            for a in r.get("agreement", {}).values():
                a["tokens_per_round"] = {int(g): v for g, v in a["tokens_per_round"].items()}
    results: dict = {}
    by_weights: dict[str, str] = {}  # sha256 of model.safetensors -> checkpoint evaluated with it
    if float_ppl is None:
        float_dir, _ = converted(work, "float-norot", src, None, None, args)
        fl = load_checkpoint(float_dir)
        float_ppl = perplexity(fl.params, fl.config, wikitext_ids(args.wikitext, load_tokenizer(float_dir),
                                                                   args.ppl_tokens),
                               window=args.window, precision=W16A16)
        del fl
    print(f"W16A16 float: ppl {float_ppl:.3f}", flush=True)
    scheme_tag = f"{'sym' if args.symmetric else 'asym'}-g{args.group_size or 'ch'}"
    for method in args.methods.split(","):
        for rotation in rotations:
            name = f"{method}-{scheme_tag}-{ROTATIONS[rotation]}"
            out, seconds = converted(work, name, src, QuantScheme(args.group_size or None, args.symmetric, method),
                                     None if rotation == "none" else 0, args,
                                     learn if rotation == "learned" else None)
            ck = load_checkpoint(out)
            if rotation == "learned" and isinstance(learn, LearnOptions):  # trained once, folded into the rest
                learn = LearnedRotation(ck.rotation_matrix, ck.manifest["rotation"]["learned"], ck.head_rotations)
            digest = ck.manifest["files"]["model.safetensors"] + str(ck.online_rotation_seed)
            if digest in by_weights:  # bitwise the same weights: the same numbers
                print(f"{name}: weights identical to {by_weights[digest]}", flush=True)
                results[name] = dict(results[by_weights[digest]], same_weights_as=by_weights[digest])
            elif done.get(name, {}).get("digest") == digest:  # the same weights, measured the same way
                print(f"{name}: reusing earlier results", flush=True)
                results[name] = dict(done[name])
            else:
                tok = load_tokenizer(out)
                wiki = wikitext_ids(args.wikitext, tok, args.ppl_tokens)
                print(f"{name}:", flush=True)
                results[name] = evaluate_checkpoint(ck, tok, wiki, args.window, questions, args.max_answer_tokens,
                                                    ("w4a16", "w4a8", "w4a4"))
                results[name]["digest"] = digest
            results[name]["conversion_s"] = seconds  # its own, also where the numbers are another's
            if rotation == "learned":
                results[name]["learned"] = ck.manifest["rotation"]["learned"]
            by_weights.setdefault(digest, name)
            write_report(args.out, results, float_ppl, args, settings, command_line("bench.quality", argv))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
