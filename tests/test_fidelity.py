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
