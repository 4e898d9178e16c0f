"""bench/kernels.py end to end in its ``--smoke`` mode (tiny shapes, kernels in interpret mode, host
timing): every part runs and reports, the attention rows include the draft's INT8 / INT4 shadow, and
the kernels agree with XLA's attention to float rounding (over the shadow: XLA attending over the
dequantized shadow, so swapped scales or planes would show)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import kernels


def test_kernels_smoke_reports_every_part(tmp_path, monkeypatch):
    for name in ("MODELS", "DEFAULT_MODELS", "MS", "CHECK_CASES", "ATTN", "L2_BYTES", "CALLS", "COPY_ELEMS"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))  # --smoke rebinds them: restored after
    monkeypatch.setattr(kernels, "KW", {})
    kernels.main(["--smoke", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "kernels.json").read_text())
    assert res["check_ok"] is True
    assert {r["shape"] for r in res["table"].values()} == {"a", "odd"}
    odd = [r for r in res["table"].values() if r["shape"] == "odd"]  # N = 40: the kernels reject it, XLA runs
    assert all("error" in r["w4a16"] and "us" in r["xla_bf16"] for r in odd)
    rows = list(res["attn"].values())
    assert sorted(r["T"] for r in rows) == [1, 4]
    for r in rows:
        assert r["kernel"]["us"] > 0 and r["max_rel_diff"] < 1e-2
        assert set(r["shadow"]) == {"8", "4"}
        for bits, e in r["shadow"].items():
            assert e["us"] > 0 and e["floor_us"] < r["floor_us"]  # a shadow moves fewer bytes
            assert e["max_rel_diff"] < 1e-2  # against XLA over the dequantized shadow: float16 rounding only
    md = (tmp_path / "kernels.md").read_text()
    assert "INT8 shadow µs (× its floor)" in md and "GPU correctness checks" in md


def test_kinds_limit_the_table_to_the_matmuls_named(tmp_path, monkeypatch, capsys):
    """--kinds: the table's rows hold the kinds named only, the others shown as not measured; an unknown
    kind is refused with the known ones listed. --mosaic-programs reaches the Mosaic kernel's calls."""
    for name in ("MODELS", "DEFAULT_MODELS", "MS", "CHECK_CASES", "ATTN", "L2_BYTES", "CALLS", "COPY_ELEMS"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    monkeypatch.setattr(kernels, "KW", {})
    monkeypatch.setattr(kernels, "MOSAIC_KW", {})
    kernels.main(["--smoke", "--parts", "table", "--kinds", "xla_int4,xla_bf16", "--mosaic-programs", "3",
                  "--out", str(tmp_path)])
    assert kernels.MOSAIC_KW == {"programs": 3}
    res = json.loads((tmp_path / "kernels.json").read_text())
    assert res["runs"][-1]["kinds"] == ["xla_bf16", "xla_int4"]
    for row in res["table"].values():
        assert set(kernels.KINDS) & set(row) == {"xla_bf16", "xla_int4"} and row["xla_bf16"]["us"] > 0
    md = (tmp_path / "kernels.md").read_text()
    assert "kinds: xla_bf16, xla_int4" in md and "n/a: w4a16 a: not measured" in md
    with pytest.raises(SystemExit):
        kernels.main(["--smoke", "--kinds", "w4a16,w5a16", "--out", str(tmp_path)])
    assert "unknown kind(s) ['w5a16']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kernels.main(["--smoke", "--mosaic-programs", "0", "--out", str(tmp_path)])


def test_a_check_that_stops_early_is_not_reported_passed(tmp_path, monkeypatch):
    """Resuming a file whose check had passed, a check part that raises leaves no verdict: kernels.md
    must not say PASSED for kernels whose check never ran."""
    for name in ("MODELS", "DEFAULT_MODELS", "MS", "CHECK_CASES", "ATTN", "L2_BYTES", "CALLS", "COPY_ELEMS"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    monkeypatch.setattr(kernels, "KW", {})
    old = {"runs": [{"command": "old", "date": "x", "device": "H200", "jax": "0", "seed": 0, "parts": ["check"],
                     "models": [], "timing": "t"}], "table": {}, "attn": {}, "check": [{"ok": True}], "check_ok": True}
    (tmp_path / "old.json").write_text(json.dumps(old))

    def broken(*args, **kwargs):
        raise RuntimeError("the kernel under test fails")

    monkeypatch.setattr(kernels.gm, "w4a16_matmul", broken)
    kernels.main(["--smoke", "--parts", "check", "--out", str(tmp_path / "new"), "--resume", str(tmp_path / "old.json")])
    res = json.loads((tmp_path / "new" / "kernels.json").read_text())
    assert "check" in res["runs"][-1]["errors"] and "check_ok" not in res
    assert "PASSED" not in (tmp_path / "new" / "kernels.md").read_text()


def test_prune_runs_keeps_the_runs_rows_refer_to():
    """A resumed file whose rows were all measured again keeps neither the runs nor the numbering of
    the runs it no longer shows; the last run (this one) stays even with nothing measured."""
    rng = np.random.default_rng()
    n = int(rng.integers(4, 8))
    runs = [{"command": f"run {i}"} for i in range(n)]
    keep = sorted(rng.choice(n - 1, 2, replace=False).tolist())
    res = {"runs": runs, "table": {"a": {"run": keep[0]}, "b": {"run": keep[1]}}, "attn": {"c": {"run": keep[1]}},
           "check": [], "check_run": keep[1]}
    kernels.prune_runs(res)
    assert [r["command"] for r in res["runs"]] == [f"run {keep[0]}", f"run {keep[1]}", f"run {n - 1}"]
    assert (res["table"]["a"]["run"], res["table"]["b"]["run"], res["attn"]["c"]["run"], res["check_run"]) == (0, 1, 1, 1)


def test_input_prep_excluded_ratio_leaves_out_only_the_prep_kernels():
    rng = np.random.default_rng()
    t = {name: float(rng.uniform(0.5, 50)) for name in
         ("_w4a16_kernel", "loop_transpose_fusion", "loop_add_fusion", "_prologue_kernel", "_w4ax_kernel",
          "loop_multiply_fusion")}
    w4a16 = {"us": t["_w4a16_kernel"] + t["loop_transpose_fusion"] + t["loop_add_fusion"], "timing": "kernels",
             "kernels": {n: t[n] for n in ("_w4a16_kernel", "loop_transpose_fusion", "loop_add_fusion")}}
    w4a4 = {"us": t["_prologue_kernel"] + t["_w4ax_kernel"] + t["loop_multiply_fusion"], "timing": "kernels",
            "kernels": {n: t[n] for n in ("_prologue_kernel", "_w4ax_kernel", "loop_multiply_fusion")}}
    assert np.isclose(kernels.without_prep(w4a16, "w4a16")["us"], t["_w4a16_kernel"] + t["loop_add_fusion"])
    assert np.isclose(kernels.without_prep(w4a4, "w4a4")["us"], t["_w4ax_kernel"] + t["loop_multiply_fusion"])
    row = {"shape": "s", "N": 64, "K": 64, "M": 1, "w4a16": w4a16, "w4a4": w4a4,
           "xla_bf16": {"us": 1.0, "pct_copy": 1.0}, "xla_int4": {"us": 1.0, "pct_copy": 1.0}}
    for e in (w4a16, w4a4):
        e["pct_copy"] = 1.0
    cells = kernels._model_table([row])[2].split(" | ")
    expect = (t["_w4a16_kernel"] + t["loop_add_fusion"]) / (t["_w4ax_kernel"] + t["loop_multiply_fusion"])
    # the prep-excluded ratio, then the Mosaic kernel's and tokamax's (not in this row: no ratio)
    assert cells[-3:] == [f"{expect:.2f}×", "n/a", "n/a |"]
    # host wall timing has no per-kernel breakdown: no ratio rather than a wrong one
    assert "error" in kernels.without_prep({"us": 3.0, "timing": "host wall", "kernels": {}}, "w4a4")


def test_every_benchmark_reads_one_shape_table():
    """bench/shapes.py is the one model-shape table: decode, profile and hf_baseline use its configs,
    kernels their linears (fused qkv and gate/up, as the converter lays them out)."""
    from bench import decode, hf_baseline, profile, shapes

    assert decode.MODELS is shapes.MODELS and profile.MODELS is shapes.MODELS and hf_baseline.MODELS is shapes.MODELS
    assert kernels.MODELS["llama3-8b"] == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                           "down": (4096, 14336), "lm_head": (128256, 4096)}
    assert kernels.MODELS["llama2-70b"]["qkv"] == (10240, 8192) and "smoke" not in kernels.MODELS
    assert kernels.DEFAULT_MODELS == ("llama3-8b", "llama2-7b", "llama2-13b")
