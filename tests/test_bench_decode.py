"""bench/decode.py end to end on a tiny random model (CPU): every method runs, QSPEC's accept
decisions follow the replayed trace (so its round count is known in advance), the report is written."""

from __future__ import annotations

import json

from bench import decode


def test_decode_bench_smoke(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "constant test trace", "w4a8": {"3": [[2, 2], [2, 2]]}}))
    out = tmp_path / "out"
    decode.main(["--models", "smoke", "--batches", "2", "--contexts", "64", "--new", "16", "--gammas", "3",
                 "--drafts", "w4a8", "--ar", "w4a16,w4a8", "--kernels", "reference", "--trace", str(trace),
                 "--out", str(out)])
    run = json.loads((out / "decode.json").read_text())
    (res,) = run["results"]
    assert set(res["methods"]) == {"w4a16", "w4a8", "qspec w4a8 g=3"}
    q = res["methods"]["qspec w4a8 g=3"]
    assert abs(q["tokens_per_round"] - 16 / 6) < 1e-9  # 2 accepted + 1 per round: 16 tokens in 6 rounds
    assert all(e["tokens_per_s"] > 0 for e in res["methods"].values())
    assert "replayed" in (out / "decode.md").read_text()
