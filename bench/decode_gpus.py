"""bench.decode over the GPUs of one host: one process per GPU, each measuring its share of the
(model, context, batch) configurations (``bench.decode --shard I/N``, split by estimated cost), all
merged into one decode.json / decode.md. Issue 5's whole matrix is 40-60 minutes on one H200; on N
GPUs of one host it is about 1/N of that, each configuration on its own GPU. One shard may compile
while another times, on the same host's CPUs: in one process a compile beside the timings slowed them
up to 1.8x (bench/results/decode_timing_check.md); whether another process's compile does is not yet
measured. Each shard's :func:`bench.decode.phase_check` marks a section so slowed as ``disturbed``.

    PYTHONPATH=. python3 -m bench.decode_gpus --gpus 4 [--out DIR] [--resume OLD.json] \\
        [every other bench.decode argument, passed on to each shard]
    PYTHONPATH=. python3 -m bench.decode_gpus --gpus 4 --merge-only [--out DIR] [--resume OLD.json]

Shard I runs on the I-th GPU this process sees (``CUDA_VISIBLE_DEVICES``, or all of ``nvidia-smi``'s)
and saves after every configuration in ``DIR/decode_shards/shardI/`` (decode.json, decode.md,
log.txt), so a call killed at a time limit keeps what was measured: ``--merge-only`` merges those
folders afterwards. The merge keeps ``--resume``'s sections and adds each shard's new ones
(:func:`bench.decode.record`: a re-measured section replaces the old one in place, a skipped one
never replaces a measured one). Relative paths are the caller's: the shards run in its folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.decode import markdown, record, save
from bench.args import command_line

ROOT = Path(__file__).resolve().parents[1]


def merge(old: dict | None, runs: list[dict], command: str) -> dict:
    """One run from the shards' ``runs`` (their device, bandwidth and rates from the first) on top of
    ``old`` (a ``--resume`` file, or None); a shard's section equal to one of ``old``'s is old."""
    kept = [r for r in old["results"] if "skipped" not in r] if old else []
    run = {**{k: v for k, v in runs[0].items() if k != "results"}, "results": list(kept),
           "command": f"{old['command']}; then {command}" if old else command}
    for shard in runs:
        for res in shard["results"]:
            if res not in kept:
                record(run, res)
    return run


def visible_gpus() -> list[str] | None:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries: that variable's list, else
    one per line of ``nvidia-smi -L``; None on a machine without NVIDIA GPUs (a CPU test)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g]
    if not shutil.which("nvidia-smi"):
        return None
    lines = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [str(i) for i, line in enumerate(ln for ln in lines if ln.startswith("GPU "))]


def load_shards(dirs: list[Path]) -> list[dict]:
    """The shards' decode.json files that exist and parse (a shard killed while writing leaves a
    truncated one: skipped, with a note)."""
    runs = []
    for d in dirs:
        try:
            runs.append(json.loads((d / "decode.json").read_text()))
        except FileNotFoundError:
            pass
        except json.JSONDecodeError as e:
            print(f"{d / 'decode.json'} unreadable, left out: {e}", file=sys.stderr)
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, required=True, help="GPUs of this host to use, one shard each")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    ap.add_argument("--resume", type=Path, default=None, help="an earlier decode.json: its configurations are kept")
    ap.add_argument("--merge-only", action="store_true",
                    help="run nothing: merge the shard folders an earlier (killed) call left in DIR/decode_shards")
    args, rest = ap.parse_known_args(argv)
    if args.gpus < 1:
        ap.error("--gpus must be at least 1")
    for flag in ("--shard", "--record-trace"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            ap.error(f"{flag} is bench.decode's own; bench.decode_gpus sets the shards")
    gpus = visible_gpus()
    if gpus is not None and len(gpus) < args.gpus and not args.merge_only:
        ap.error(f"--gpus {args.gpus}, but this process sees {len(gpus)} GPU(s)")
    old = json.loads(args.resume.read_text()) if args.resume else None
    dirs = [args.out / "decode_shards" / f"shard{i}" for i in range(args.gpus)]
    failed = []
    if not args.merge_only:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if gpus is not None:  # on a GPU host a shard must not fall back to the CPU
            env["JAX_PLATFORMS"] = "cuda"
        procs = []
        for i, d in enumerate(dirs):
            shutil.rmtree(d, ignore_errors=True)  # an earlier call's results must not be merged as this one's
            d.mkdir(parents=True)
            cmd = [sys.executable, "-m", "bench.decode", *rest, *(["--resume", str(args.resume)] if old else []),
                   "--shard", f"{i}/{args.gpus}", "--out", str(d)]
            with open(d / "log.txt", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={
                    **env, "CUDA_VISIBLE_DEVICES": gpus[i] if gpus is not None else str(i)}))
        failed = [str(d / "log.txt") for d, proc in zip(dirs, procs) if proc.wait() != 0]
    runs = load_shards(dirs)
    if not runs and args.merge_only:
        raise SystemExit(f"no shard results under {args.out / 'decode_shards'}")
    if runs:
        command = command_line("bench.decode_gpus", argv)
        run = merge(old, runs, command)
        save(run, args.out)
        print(markdown({**run, "results": [r for r in run["results"] if "skipped" not in r]}))
    if failed:
        raise SystemExit(f"{len(failed)} of {args.gpus} shards failed; their logs: {', '.join(failed)}")


if __name__ == "__main__":
    main()
