"""bench.tp's options: bad ones are refused before anything runs (its measurements: tests/tp_cases.py)."""

from __future__ import annotations

import pytest

from bench import tp as bench_tp


@pytest.mark.parametrize("argv, message", [
    (["--tp", "1"], "expected an integer >= 2"),
    (["--tp", "2", "--models", "llama9"], "unknown models"),
    (["--tp", "2", "--drafts", "w4a8/head64", "--trace", "t.json"], "draft heads are not sharded"),
    (["--tp", "2", "--drafts", "w4a9", "--trace", "t.json"], "unknown draft"),
    (["--tp", "2"], "needs --trace"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_tp.parse_args(argv)
    assert message in capsys.readouterr().err


def test_more_shards_than_devices_is_refused(tmp_path):
    import jax

    n = jax.device_count() + 1
    with pytest.raises(SystemExit, match=f"--tp {n} needs {n} devices"):
        bench_tp.main(["--tp", str(n), "--drafts", "", "--out", str(tmp_path)])
