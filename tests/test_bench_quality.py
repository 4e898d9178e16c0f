"""bench/quality.py's caching, with conversion and evaluation stubbed: a converted checkpoint or a
resumed result is reused only for the same source, scheme, calibration and evaluation settings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bench import quality
from convert.learn_rotation import LearnOptions


@pytest.fixture
def stubbed(tmp_path, monkeypatch):
    """``quality.main`` with fake conversions (recorded; their 'weights' name the source and sample count)
    and an evaluation whose perplexity encodes the checkpoint evaluated and the window."""
    calls = []

    def convert(src, out, scheme, rotation_seed, calibration=None, n_samples=64, seq_len=512, learned=None):
        trained = isinstance(learned, LearnOptions)
        calls.append((Path(src).name, "float" if scheme is None else scheme.method, n_samples,
                      "trained" if trained else "reused" if learned else None))
        out.mkdir(parents=True)
        weights = (f"{Path(src).name}/{scheme}/{rotation_seed}/{n_samples if scheme and scheme.method == 'gptq' else ''}"
                   f"/{learned is not None}")
        record = None if learned is None else learned.record if not trained else {
            **dataclasses.asdict(learned), "seed": rotation_seed, "loss": [2.0, 1.0], "seconds": 7.0}
        (out / "manifest.json").write_text(json.dumps({"files": {"model.safetensors": weights}, "rot": rotation_seed,
                                                       "rotation": {"learned": record}}))

    class Checkpoint:
        def __init__(self, d):
            self.manifest = json.loads((Path(d) / "manifest.json").read_text())
            self.online_rotation_seed, self.params, self.config = self.manifest["rot"], None, None
            self.rotation_matrix = np.eye(3) if self.manifest["rotation"]["learned"] else None
            self.head_rotations = np.eye(2)[None] if self.manifest["rotation"]["learned"] else None

    def evaluate(ck, tok, wiki, window, questions, max_answer_tokens, modes):
        return {"ppl": {m: float(len(ck.manifest["files"]["model.safetensors"]) + window) for m in modes}}

    monkeypatch.setattr(quality, "convert", convert)
    monkeypatch.setattr(quality, "load_checkpoint", Checkpoint)
    monkeypatch.setattr(quality, "load_tokenizer", lambda d: None)
    monkeypatch.setattr(quality, "wikitext_ids", lambda path, tok, n: np.zeros(n, np.int32))
    monkeypatch.setattr(quality, "perplexity", lambda *a, window, **k: float(window))
    monkeypatch.setattr(quality, "evaluate_checkpoint", evaluate)
    for name in ("a.gguf", "b.gguf", "wiki.raw", "calib.jsonl"):
        (tmp_path / name).write_text(name)
    base = ["--wikitext", str(tmp_path / "wiki.raw"), "--calibration", str(tmp_path / "calib.jsonl"),
            "--workdir", str(tmp_path / "work"), "--methods", "gptq", "--out", str(tmp_path / "q.md"),
            "--gguf", str(tmp_path / "a.gguf")]
    return base, calls, tmp_path


def _plain(src, n):
    """The conversions of a run without learned rotations: float, then GPTQ without and with a Hadamard."""
    return [(src, "float", n, None), (src, "gptq", n, None), (src, "gptq", n, None)]


def test_quality_converts_again_for_other_settings(stubbed):
    base, calls, tmp = stubbed
    quality.main([*base, "--rotations", "none,hadamard"])
    assert sorted(calls, key=str) == _plain("a.gguf", 64)
    calls.clear()
    quality.main([*base, "--rotations", "none,hadamard"])  # the same settings: every checkpoint reused
    assert calls == []
    quality.main([*base[:-1], str(tmp / "b.gguf"), "--n-samples", "256", "--rotations", "none,hadamard"])
    assert sorted(calls, key=str) == _plain("b.gguf", 256)
    calls.clear()
    quality.main([*base, "--n-samples", "128", "--rotations", "none,hadamard"])  # GPTQ again, the float one reused
    assert sorted(calls, key=str) == [("a.gguf", "gptq", 128, None)] * 2


def test_quality_trains_the_learned_rotation_once(stubbed):
    """--methods rtn,gptq with a learned rotation: trained in the first learned conversion, its matrix
    folded into the second, whose conversion time includes the training's; other options train anew."""
    base, calls, tmp = stubbed
    args = [*base[:base.index("--methods")], "--methods", "rtn,gptq", *base[base.index("--methods") + 2:],
            "--rotations", "learned", "--rotation-steps", "5"]
    quality.main(args)
    assert [c[1:] for c in calls[1:]] == [("rtn", 64, "trained"), ("gptq", 64, "reused")]
    res = json.loads((tmp / "q.json").read_text())["results"]
    assert set(res) == {"rtn-asym-g32-learned", "gptq-asym-g32-learned"}
    assert res["gptq-asym-g32-learned"]["learned"]["steps"] == 5
    assert res["gptq-asym-g32-learned"]["conversion_s"] >= 7.0
    calls.clear()
    quality.main(args)
    assert calls == []
    quality.main([*args, "--rotation-lr", "0.002"])
    assert [c[1:] for c in calls] == [("rtn", 64, "trained"), ("gptq", 64, "reused")]
    with pytest.raises(SystemExit):
        quality.main([*args, "--rotations", "spin"])
    with pytest.raises(SystemExit):
        quality.main([*args, "--rotation-steps", "0"])


def test_quality_resume_only_with_the_same_settings(stubbed):
    base, calls, tmp = stubbed
    base = [*base, "--rotations", "none,hadamard"]
    quality.main(base)
    first = json.loads((tmp / "q.json").read_text())
    quality.main([*base, "--resume"])
    assert json.loads((tmp / "q.json").read_text())["results"] == first["results"]
    with pytest.raises(SystemExit, match="measured with other settings"):
        quality.main([*base, "--resume", "--window", "128"])
    quality.main([*base, "--resume", "--n-samples", "128"])  # other weights: measured, not reused
    again = json.loads((tmp / "q.json").read_text())["results"]
    assert all(again[n]["digest"] != first["results"][n]["digest"] for n in again)


def test_quality_converts_again_after_a_converter_change(stubbed, monkeypatch):
    base, calls, tmp = stubbed
    base = [*base, "--rotations", "none,hadamard"]
    quality.main(base)
    calls.clear()
    monkeypatch.setattr(quality, "converter_code", lambda: "another-version")
    quality.main(base)
    assert sorted(calls, key=str) == _plain("a.gguf", 64)


def test_converter_code_digest_follows_the_converters_source(tmp_path, monkeypatch):
    for pkg in ("convert", "qspec_jax", "pallas_kernels"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "m.py").write_text(f"# {pkg}")
    (tmp_path / "bench").mkdir()
    monkeypatch.setattr(quality, "__file__", str(tmp_path / "bench" / "quality.py"))
    before = quality.converter_code()
    assert quality.converter_code() == before
    (tmp_path / "convert" / "m.py").write_text("# changed")
    assert quality.converter_code() != before


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_agreement_simulates_the_rounds_after_the_prefill_token(monkeypatch, gamma):
    """The draft disagrees with W4A16 only where the prefill picks the answer's first token: QSPEC's
    rounds never see that position, so alpha is 1 and each answer's n - 1 later tokens take
    ceil((n - 1) / (gamma + 1)) rounds."""
    rng = np.random.default_rng()
    prompts = [list(rng.integers(1, 50, rng.integers(2, 9))) for _ in range(3)]
    answers = [list(rng.integers(1, 50, rng.integers(2, 30))) for _ in range(3)]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    target = rng.integers(0, 50, (3, width))
    draft = target.copy()
    for i, p in enumerate(prompts):
        draft[i, len(p) - 1] += 1  # the prefill's position (predicts the answer's first token)
    tops = {"w4a16": target, "w4a4": draft, "w4a8": draft}
    monkeypatch.setattr(quality, "token_scores",
                        lambda params, config, tokens, precision, **kw: (None, tops[precision.name]))
    ck = type("Ck", (), {"params": None, "config": None, "online_rotation_seed": None})()
    res = quality.agreement(ck, prompts, answers)
    later = [len(a) - 1 for a in answers]
    for draft_mode in quality.DRAFTS:
        assert res[draft_mode]["alpha"] == 1.0 and res[draft_mode]["tokens"] == sum(later)
        rounds = sum(-(-n // (gamma + 1)) for n in later)
        assert res[draft_mode]["tokens_per_round"][gamma] == pytest.approx(sum(later) / rounds, rel=1e-12)
