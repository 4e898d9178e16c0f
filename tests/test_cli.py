"""``qspec-jax generate``: its flags reach ``generate`` (the defaults included), its output names the
finish reason, and bad input ends with exit code 2 and the library's message, not a traceback."""

from __future__ import annotations

import numpy as np
import pytest

from convert.pipeline import convert_model
from convert.quantize import QuantScheme
import qspec_jax.api as api
from convert import qspec_cli as cli
from tests.conftest import TINY, memory_model, random_source


def _streaming(fake_generate):
    """A stream_generate made of ``fake_generate``: one update carrying its result."""
    def stream(model, prompts, chunk_rounds=8, **kw):
        res = fake_generate(model, prompts, **kw)
        yield api.StreamUpdate(res.sequences, res.texts, [True] * len(res.sequences), res)
    return stream


def test_generate_flags_reach_generate(monkeypatch, capsys, rng):
    calls = []
    seed = int(rng.integers(1, 2**31))

    def fake_generate(model, prompts, **kw):
        calls.append((model, prompts, kw))
        return api.GenerationResult([np.zeros(2, np.int32)], np.ones(1), np.full(1, 2), ["eos"], ["an answer"],
                                    api._stats(None, 0.0, True))

    monkeypatch.setattr(api, "load", lambda path: ("model at", path))
    monkeypatch.setattr(cli, "default_checkpoint", lambda: "embedded")
    monkeypatch.setattr(api, "generate", fake_generate)
    monkeypatch.setattr(api, "stream_generate", _streaming(fake_generate))
    argv = ["generate", "--prompt", "hi", "--checkpoint", "ck", "--temperature", "0.5", "--top-k", "3",
            "--seed", str(seed), "--draft-kv", "8", "--chat"]
    assert cli.main(argv) == 0
    (model, prompts, kw), = calls
    assert str(model[1]) == "ck" and prompts == ["hi"]
    # gamma and draft unset: generate()'s own defaults apply
    assert kw == dict(max_new_tokens=96, method="qspec", draft_kv=8, temperature=0.5, top_k=3, top_p=None, seed=seed,
                      chat=True, system=None, stop=None, eos_token_id=None, max_len=None, dtype=None,
                      return_logprobs=False, tensor_parallel=1)
    out, err = capsys.readouterr()
    assert out.endswith("\nan answer\n") and "[finish: eos]" in err and "tok/s" in err  # stats on stderr
    assert cli.main(["generate", "--prompt", "hi", "--gamma", "5", "--draft", "w4a4"]) == 0
    assert calls[-1][2]["gamma"] == 5 and calls[-1][2]["draft"] == "w4a4"
    assert cli.main(["generate", "--prompt", "hi", "--method", "w4a16", "--gamma", "2", "--draft", "w4a4"]) == 2
    assert len(calls) == 2 and "--gamma, --draft apply to --method qspec only" in capsys.readouterr().err
    argv = ["generate", "--prompt", "hi", "--gamma", "auto", "--draft-window", "512", "--draft-sinks", "4",
            "--draft-head", "4096", "--draft-head-bits", "4"]
    assert cli.main(argv) == 0
    keys = ("gamma", "draft_window", "draft_sinks", "draft_head", "draft_head_bits")
    assert {k: calls[-1][2][k] for k in keys} == dict(
        gamma="auto", draft_window=512, draft_sinks=4, draft_head=4096, draft_head_bits=4)
    assert cli.main(["generate", "--prompt", "hi", "--draft-window", "none"]) == 0
    assert calls[-1][2]["draft_window"] is None  # drafts over the whole cache
    assert cli.main(["generate", "--prompt", "hi", "--method", "w4a16", "--draft-head-bits", "4"]) == 2
    assert "--draft-head-bits applies to --method qspec only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "hi", "--gamma", "three"])
    assert "expected 'auto' or an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "hi", "--draft-window", "all"])
    assert "expected 'none' or an integer" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [(["--top-k", "5"], "temperature=0"), (["--gamma", "0"], "gamma"),
                                           (["--seed", str(2**70)], "seed"),
                                           (["--max-new-tokens", "-1"], "max_new_tokens"),
                                           (["--tensor-parallel", "0"], "tensor_parallel must be an integer >= 1")])
def test_generate_bad_input_exits_2(monkeypatch, capsys, rng, flags, message):
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, False), None)
    monkeypatch.setattr(api, "load", lambda path: memory_model(params, cfg))
    monkeypatch.setattr(cli, "default_checkpoint", lambda: "embedded")
    capsys.readouterr()  # the conversion's progress bar
    assert cli.main(["generate", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qspec-jax: error: ") and message in err


def test_generate_reads_prompts_and_writes_json_lines(monkeypatch, capsys, tmp_path):
    """--input (lines, or JSON lines with prompts or conversations; '-' is stdin) in batches of
    --batch-size; --json prints one object per prompt in order; the new flags reach generate()."""
    import io
    import json

    calls = []

    def fake_generate(model, prompts, **kw):
        calls.append((prompts, kw))
        n = len(prompts)
        return api.GenerationResult([np.arange(i + 1, dtype=np.int32) for i in range(n)], np.ones(n), np.ones(n),
                                    ["stop"] * n, [f"answer {len(calls)}.{i}" for i in range(n)],
                                    api._stats(None, 1.0, True),
                                    [np.full(i + 1, -0.5, np.float32) for i in range(n)] if kw["return_logprobs"]
                                    else None)

    monkeypatch.setattr(api, "load", lambda path: "model")
    monkeypatch.setattr(cli, "default_checkpoint", lambda: "embedded")
    monkeypatch.setattr(api, "generate", fake_generate)
    monkeypatch.setattr(api, "stream_generate", _streaming(fake_generate))
    lines = tmp_path / "prompts.txt"
    lines.write_text("first\n\nsecond\nthird\n")
    argv = ["generate", "--input", str(lines), "--batch-size", "2", "--json", "--logprobs", "--stop", "\n\n",
            "--stop", "Q:", "--eos", "3,5", "--dtype", "bfloat16", "--max-len", "300", "--chat", "--system", "s"]
    assert cli.main(argv) == 0
    assert [p for p, _ in calls] == [["first", "second"], ["third"]]
    kw = calls[0][1]
    assert (kw["stop"], kw["eos_token_id"], kw["dtype"], kw["max_len"], kw["system"]) == (
        ["\n\n", "Q:"], [3, 5], "bfloat16", 300, "s")
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and rows[2]["text"] == "answer 2.0"
    assert rows[1]["tokens"] == [0, 1] and rows[1]["logprobs"] == [-0.5, -0.5] and rows[0]["finish_reason"] == "stop"
    convo = [{"role": "user", "content": "hi"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"messages": convo}) + "\n")
    assert cli.main(["generate", "--input", str(jsonl), "--chat"]) == 0
    assert calls[-1][0] == ["a", convo]
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"prompt": "from stdin"}) + "\n"))
    assert cli.main(["generate", "--input", "-", "--jsonl", "--eos", "-1"]) == 0
    assert calls[-1][0] == ["from stdin"] and calls[-1][1]["eos_token_id"] == -1
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    for content, message in (("not json\n", "line 1: not JSON"), ('{"text": "x"}\n', "line 1: expected an object"),
                             ("\n\n", "no prompts")):
        bad.write_text(content)
        assert cli.main(["generate", "--input", str(bad)]) == 2
        assert message in capsys.readouterr().err
    for argv, message in ((["--prompt", "a", "--input", str(lines)], "not both"), ([], "give prompts"),
                          (["--prompt", "a", "--logprobs"], "--logprobs goes with --json"),
                          (["--prompt", "a", "--batch-size", "0"], "--batch-size must be >= 1")):
        assert cli.main(["generate", *argv]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "a", "--eos", "x"])
    assert "expected token ids" in capsys.readouterr().err


def test_version_and_help_name_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == "qspec-jax 0.1.0"
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--input", "--batch-size", "--json", "--stop", "--eos", "--max-len", "--dtype", "--logprobs",
                 "--system", "--method", "--prompt"):
        assert flag in text
    assert "(default: 8)" in text and "(default: qspec)" in text
