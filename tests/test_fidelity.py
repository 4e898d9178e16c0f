"""GSM8K answer extraction of bench/fidelity.py (lm-evaluation-harness conventions), on hand-written
outputs, and the token agreement measure."""

from __future__ import annotations

import numpy as np
import pytest

from bench.fidelity import agreement, extract, reference_answer


def test_extraction_strict_and_flexible():
    assert extract("so 3 + 4 = 7.\n#### 7") == ("7", "7")
    assert extract("She pays $1,250.50 in total.") == (None, "1250.50")
    assert extract("The answer is -12 apples, not 5") == (None, "5")
    assert extract("#### 1,000\nThen 3 more") == ("1000", "3")
    assert extract("no digits here") == (None, None)
    assert reference_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"


def test_token_agreement_counts_positions_over_the_longer_output():
    a, b = np.array([1, 2, 3, 4]), np.array([1, 9, 3])
    assert agreement(a, b) == (2, 4)
    assert agreement(a, a) == (4, 4)


def test_unknown_draft_is_rejected_before_any_work(tmp_path, capsys):
    """``--drafts`` takes MODE or MODE/kvBITS; anything else stops with a message naming it."""
    from bench import fidelity

    dev = tmp_path / "dev.jsonl"
    dev.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    for bad in ("w4a9", "w4a8/kv5", "w4a8/kv"):
        with pytest.raises(SystemExit):
            fidelity.main(["--gsm8k", str(dev), "--drafts", bad])
        assert f"error: --drafts: unknown draft '{bad}'" in capsys.readouterr().err


def test_fidelity_end_to_end_on_smollm2(tmp_path):
    """Every method on two problems with the embedded SmolLM2 (reference kernels): the autoregressive
    methods run without QSPEC's settings; W4A16 is identical to itself, QSPEC to W4A16 (greedy), and
    QSPEC reports its acceptance and tokens per round."""
    import json

    from bench import fidelity

    dev = tmp_path / "dev.jsonl"
    rows = [{"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "#### 7"},
            {"question": "A pen costs 2 dollars. How much do 5 pens cost?", "answer": "#### 10"}]
    dev.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "fidelity.md"
    fidelity.main(["--gsm8k", str(dev), "--max-new-tokens", "6", "--batch", "2", "--drafts", "w4a8/win8+4",
                   "--kernels", "reference", "--out", str(out)])
    doc = json.loads(out.with_suffix(".json").read_text())
    assert set(doc["methods"]) == {*fidelity.AR_METHODS, "qspec-w4a8/win8+4"}
    assert doc["methods"]["w4a16"]["identical"] == 2
    r = doc["methods"]["qspec-w4a8/win8+4"]  # drafts over a window far shorter than the prompts
    assert r["identical"] == 2 and 0 <= r["acceptance"] <= 1 and 1 <= r["tokens_per_round"] <= 4
    assert "acceptance" not in doc["methods"]["w4a8"] and "| qspec-w4a8/win8+4 |" in out.read_text()
