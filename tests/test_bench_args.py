"""The bench scripts refuse bad arguments and input files before measuring anything (bench/args.py)."""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest

from bench import args as bargs
from bench import decode, fidelity, kernels, plot


def test_argument_types(rng):
    n = int(rng.integers(2, 100))
    assert bargs.at_least(n)(str(n)) == n
    values = rng.integers(1, 1000, int(rng.integers(1, 6))).tolist()
    assert bargs.int_list()(",".join(map(str, values))) == values
    assert bargs.positive_seconds("inf") == float("inf") and bargs.positive_seconds("2.5") == 2.5
    for parse, text in [(bargs.at_least(n), str(n - 1)), (bargs.positive_int, "0"), (bargs.positive_int, "1.5"),
                        (bargs.int_list(), ""), (bargs.int_list(), "4,x"), (bargs.int_list(), "4,-1"),
                        (bargs.positive_seconds, "-5"), (bargs.positive_seconds, "nan"),
                        (bargs.positive_seconds, "0")]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_input_files_are_named(tmp_path):
    f = tmp_path / "in.json"
    want = r"expected a JSON object with 'command' \(a string\), 'results' \(an array\)"
    for text, match in [("{", "not a readable JSON file"), ("[]", want), ('{"command": "x"}', want),
                        ('{"command": "x", "results": null}', want), ('{"command": 5, "results": []}', want)]:
        f.write_text(text)
        with pytest.raises(SystemExit, match=match):
            bargs.read_json(f, "--resume", {"command": str, "results": list})
    f.write_text("[1]")
    with pytest.raises(SystemExit, match=r"in\.json: expected a JSON object$"):
        bargs.read_json(f, "--trace")
    f.write_text('{"command": "x", "results": [], "more": 1}')
    assert bargs.read_json(f, "--resume", {"command": str, "results": list})["more"] == 1
    g = tmp_path / "g.jsonl"
    for text, match in [("", "holds no problems"), ("\n\n", "holds no problems"),
                        ('{"question": "q", "answer": "a"}\nnot json', r"g\.jsonl:2: not JSON"),
                        ('{"question": "q"}', r"g\.jsonl:1: expected an object with string 'question' and 'answer'"),
                        ('[1, 2]', r"g\.jsonl:1: expected an object"),
                        ('{"question": "q", "answer": 4}', r"g\.jsonl:1: expected an object")]:
        g.write_text(text)
        with pytest.raises(SystemExit, match=match):
            bargs.read_gsm8k(g)
    g.write_text('{"question": "q"}\n')
    assert bargs.read_gsm8k(g, answers=False) == [{"question": "q"}]
    with pytest.raises(SystemExit, match="no such GSM8K file"):
        bargs.read_gsm8k(tmp_path / "missing.jsonl")


def _trace(tmp_path, doc, name: str = "trace.json") -> str:
    t = tmp_path / name
    t.write_text(json.dumps(doc))
    return str(t)


def test_decode_refuses_bad_arguments_before_measuring(tmp_path, capsys):
    good = _trace(tmp_path, {"source": "test", "w4a8": {"1": [[0, 1]]}}, "good.json")
    base = ["--models", "smoke", "--gammas", "1", "--drafts", "w4a8", "--ar", "w4a16", "--kernels", "reference",
            "--batches", "1", "--contexts", "32", "--new", "8", "--out", str(tmp_path / "out")]
    for flags in (["--batches", "0"], ["--batches", "a"], ["--contexts", "0"], ["--new", "-4"], ["--gammas", "0"],
                  ["--budget-s", "-5"], ["--budget-s", "nan"], ["--kernels", "foo"], ["--ar", "w4a16,foo"],
                  ["--threads", "0"], ["--prompts", "-1"]):
        with pytest.raises(SystemExit):
            decode.main([*base, "--trace", good, *flags])
        assert re.search(rf"error: (argument )?{flags[0]}:", capsys.readouterr().err)  # not the usage line
    for doc, match in [({"w4a8": {"1": "abc"}}, "gamma-1 entry must be a non-empty list"),
                       ({"w4a8": {"1": []}}, "gamma-1 entry must be a non-empty list"),
                       ({"w4a8": {"1": [[0, 2]]}}, r"accepted counts in \[0, 1\]"),
                       ({"w4a8": []}, r"the trace \S+ has no w4a8 rounds")]:
        with pytest.raises(SystemExit, match=match):
            decode.main([*base, "--trace", _trace(tmp_path, doc)])
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(SystemExit, match="--resume .*expected a JSON object with 'command' .*, 'results'"):
        decode.main([*base, "--trace", good, "--resume", str(tmp_path / "bad.json")])
    positions = decode.MODELS["smoke"].max_position_embeddings
    with pytest.raises(SystemExit, match=f"exceeds its {positions} positions"):
        decode.main([*base, "--trace", good, "--contexts", str(positions)])
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_fidelity_refuses_bad_arguments_before_loading(tmp_path, capsys):
    g = tmp_path / "g.jsonl"
    g.write_text('{"question": "q", "answer": "#### 1"}\n')
    base = ["--gsm8k", str(g), "--out", str(tmp_path / "f.md")]
    for flags in (["--limit", "0"], ["--limit", "-1"], ["--batch", "-1"], ["--gamma", "0"], ["--window", "1"],
                  ["--ppl-tokens", "-5"], ["--max-new-tokens", "0"]):
        with pytest.raises(SystemExit):
            fidelity.main([*base, *flags])
        assert f"argument {flags[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--wikitext: no such file"):
        fidelity.main([*base, "--wikitext", str(tmp_path / "missing.raw")])
    with pytest.raises(SystemExit, match="is a directory"):
        fidelity.main(["--gsm8k", str(g), "--out", str(tmp_path)])
    g.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "the answer is 7"}\n')
    with pytest.raises(SystemExit, match="no '####'"):
        fidelity.main(base)
    g.write_text("\n")
    with pytest.raises(SystemExit, match="holds no problems"):
        fidelity.main(base)
    for draft in ("w4a8/kv\u00b2", "w4a8/kv16", "w4a8/kv08"):
        with pytest.raises(SystemExit):
            fidelity.main([*base, "--drafts", draft])
        assert "unknown draft" in capsys.readouterr().err
    assert not (tmp_path / "f.md").exists()


def test_kernels_and_plot_refuse_bad_arguments(tmp_path, rng, capsys, monkeypatch):
    for name in ("MODELS", "DEFAULT_MODELS", "MS", "CHECK_CASES", "ATTN", "L2_BYTES", "CALLS", "COPY_ELEMS"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))  # --smoke rebinds them: restored after
    monkeypatch.setattr(kernels, "KW", {})
    for argv in (["--smoke", "--ms", "0"], ["--smoke", "--ms", "a"], ["--smoke", "--parts", ""],
                 ["--smoke", "--threads", "0"], ["--smoke", "--budget-s", "-5"]):
        with pytest.raises(SystemExit):
            kernels.main([*argv, "--out", str(tmp_path / "k")])
        assert re.search(rf"error: (argument )?{argv[1]}:", capsys.readouterr().err)
    run = tmp_path / "decode.json"
    ms = float(rng.uniform(1, 10))
    run.write_text(json.dumps({"results": [{"model": "m", "context": 512, "batch": 1, "methods": {
        "w4a16": {"tokens_per_s": 1e3 / ms}, "qspec w4a8 g=3": {"tokens_per_s": 900 / ms}}}]}))
    with pytest.raises(SystemExit, match="no QSPEC results at gamma 7"):
        plot.main([str(run), "--gamma", "7", "--out", str(tmp_path / "p.png")])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="expected a JSON object with 'results'"):
        plot.main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "p.png")])
    (tmp_path / "d.png").mkdir()
    for out in (tmp_path, tmp_path / "plot", tmp_path / "d.png"):
        with pytest.raises(SystemExit):
            plot.main([str(run), "--out", str(out)])
        assert "ending in .png" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "d.png", "decode.json"]
    res = tmp_path / "k.json"
    res.write_text('{"runs": null, "table": {}, "attn": {}}')
    with pytest.raises(SystemExit, match="'runs' \\(an array\\)"):
        kernels.main(["--smoke", "--resume", str(res), "--out", str(tmp_path / "k")])
    np.testing.assert_equal(len(plot.series(json.loads(run.read_text())["results"], 512, 3)["m"]), 2)
