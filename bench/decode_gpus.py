"""bench.decode over the GPUs of one host: one process per GPU, each measuring its share of the
(model, context, batch) configurations (``bench.decode --shard I/N``, split by estimated cost), all
merged into one decode.json / decode.md. Issue 5's whole matrix is 40-55 minutes on one H200; on N
GPUs of one host it is about 1/N of that, each configuration still timed alone on its own GPU.

    PYTHONPATH=. python3 -m bench.decode_gpus --gpus 4 [--out DIR] [--resume OLD.json] \\
        [every other bench.decode argument, passed on to each shard]

Each shard runs with ``CUDA_VISIBLE_DEVICES`` set to its GPU and writes its decode.json to a
temporary folder; the merge keeps ``--resume``'s sections and adds each shard's new ones
(:func:`bench.decode.record`: a re-measured section replaces the old one in place, a skipped one
never replaces a measured one). A failed shard's log is kept as ``DIR/decode_shardI.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.decode import markdown, record, save

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, required=True, help="GPUs of this host to use, one shard each")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    ap.add_argument("--resume", type=Path, default=None, help="an earlier decode.json: its configurations are kept")
    args, rest = ap.parse_known_args(argv)
    if args.gpus < 1:
        ap.error("--gpus must be at least 1")
    for flag in ("--shard", "--record-trace"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            ap.error(f"{flag} is bench.decode's own; bench.decode_gpus sets the shards")
    old = json.loads(args.resume.read_text()) if args.resume else None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / f"shard{i}" for i in range(args.gpus)]
        procs = []
        for i, d in enumerate(dirs):
            d.mkdir()
            cmd = [sys.executable, "-m", "bench.decode", *rest, *(["--resume", str(args.resume)] if old else []),
                   "--shard", f"{i}/{args.gpus}", "--out", str(d)]
            with open(d / "log.txt", "w") as log:
                procs.append(subprocess.Popen(cmd, env={**env, "CUDA_VISIBLE_DEVICES": str(i)}, stdout=log,
                                              stderr=subprocess.STDOUT, cwd=ROOT))
        codes = [p.wait() for p in procs]
        runs = [json.loads((d / "decode.json").read_text()) for d in dirs if (d / "decode.json").is_file()]
        args.out.mkdir(parents=True, exist_ok=True)
        failed = []
        for i, (d, code) in enumerate(zip(dirs, codes)):
            if code:
                failed.append(str(shutil.copy(d / "log.txt", args.out / f"decode_shard{i}.log")))
    if runs:
        command = " ".join(["python3 -m bench.decode_gpus", *(argv if argv is not None else sys.argv[1:])])
        run = merge(old, runs, command)
        save(run, args.out)
        print(markdown({**run, "results": [r for r in run["results"] if "skipped" not in r]}))
    if failed:
        raise SystemExit(f"{len(failed)} of {args.gpus} shards failed; their logs: {', '.join(failed)}")


if __name__ == "__main__":
    main()
