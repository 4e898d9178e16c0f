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
    argv = ["generate", "--prompt", "hi", "--checkpoint", "ck", "--temperature", "0.5", "--top-k", "3",
            "--seed", str(seed), "--draft-kv", "8", "--chat"]
    assert cli.main(argv) == 0
    (model, prompts, kw), = calls
    assert str(model[1]) == "ck" and prompts == ["hi"]
    # gamma and draft unset: generate()'s own defaults apply
    assert kw == dict(max_new_tokens=96, method="qspec", draft_kv=8, temperature=0.5, top_k=3, top_p=None, seed=seed,
                      chat=True)
    out = capsys.readouterr().out
    assert "an answer" in out and "finish: eos" in out
    assert cli.main(["generate", "--prompt", "hi", "--gamma", "5", "--draft", "w4a4"]) == 0
    assert calls[-1][2]["gamma"] == 5 and calls[-1][2]["draft"] == "w4a4"
    assert cli.main(["generate", "--prompt", "hi", "--method", "w4a16", "--gamma", "2", "--draft", "w4a4"]) == 2
    assert len(calls) == 2 and "--gamma, --draft apply to --method qspec only" in capsys.readouterr().err
    argv = ["generate", "--prompt", "hi", "--gamma", "auto", "--draft-window", "512", "--draft-sinks", "4",
            "--draft-head", "4096"]
    assert cli.main(argv) == 0
    assert {k: calls[-1][2][k] for k in ("gamma", "draft_window", "draft_sinks", "draft_head")} == dict(
        gamma="auto", draft_window=512, draft_sinks=4, draft_head=4096)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "hi", "--gamma", "three"])
    assert "expected 'auto' or an integer" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [(["--top-k", "5"], "temperature=0"), (["--gamma", "0"], "gamma"),
                                           (["--seed", str(2**70)], "seed"),
                                           (["--max-new-tokens", "-1"], "max_new_tokens")])
def test_generate_bad_input_exits_2(monkeypatch, capsys, rng, flags, message):
    params, cfg, _ = convert_model(random_source(TINY, rng), QuantScheme(16, False), None)
    monkeypatch.setattr(api, "load", lambda path: memory_model(params, cfg))
    monkeypatch.setattr(cli, "default_checkpoint", lambda: "embedded")
    capsys.readouterr()  # the conversion's progress bar
    assert cli.main(["generate", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qspec-jax: error: ") and message in err
