"""bench/decode.py end to end on a tiny random model (CPU): every method runs, QSPEC's accept
decisions follow the replayed trace (so its round count is known in advance), the report is written;
bench/plot.py draws that report; bench/hf_baseline.py's
arguments and report (its runs need a GPU)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from bench import decode, hf_baseline, plot


@pytest.fixture(autouse=True)
def _no_phase_check(monkeypatch):
    """CPU timings are host wall times with no meaning as phases: the physical check is off here, so
    that a noisy round cannot mark a test's section disturbed (its own test turns it back on)."""
    monkeypatch.setattr(decode, "PHASE_SLACK", float("inf"))
    monkeypatch.setattr(decode, "CALIBRATION", None)  # the budget's prior pace: PACE, not the repository's results


def _fake_timing(monkeypatch, events: list | None = None) -> None:
    """bench.decode's compile and timing steps replaced by stand-ins that record their order (whether
    a compile starts while a configuration is timed) and return a section with a constant row per method
    planned: for tests of the orchestration (budget, order, resume), which need no real kernels or timings."""
    events = [] if events is None else events
    timing = [False]

    def compile_config(c, threads):
        events.append(("compile", c.res["batch"], timing[0]))
        return {}

    def run_config(c, compiled, *args):
        timing[0] = True
        try:
            events.append(("run", c.res["batch"], True))
            names = [k[1] if k[0] == "ar" else f"qspec {k[1]} g={k[2]}" for k in c.jobs if k[0] in ("ar", "qspec")]
            return {**c.res, "methods": {n: {"tokens_per_s": 1.0, "ms_per_step": 1.0} for n in names}}
        finally:
            timing[0] = False

    monkeypatch.setattr(decode, "compile_config", compile_config)
    monkeypatch.setattr(decode, "run_config", run_config)


SMOKE = ["--models", "smoke", "--contexts", "64", "--new", "8", "--gammas", "1", "--drafts", "w4a8",
         "--ar", "w4a16", "--kernels", "reference"]


def _trace(tmp_path) -> list[str]:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "constant test trace", "w4a8": {"1": [[0, 1]]}}))
    return ["--trace", str(trace)]


def test_decode_bench_smoke(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "constant test trace", "w4a8": {"3": [[2, 2], [2, 2]]},
                                 "w4a8/kv4": {"3": [[1, 1]]}, "w4a8/head64q4": {"3": [[1, 1]]}}))
    out = tmp_path / "out"
    decode.main(["--models", "smoke", "--batches", "2", "--contexts", "64", "--new", "16", "--gammas", "3",
                 "--drafts", "w4a8,w4a8/kv4,w4a8/head64q4", "--ar", "w16a16,w4a16,w4a8", "--kernels", "reference",
                 "--trace", str(trace), "--out", str(out), "--label", "test build"])
    run = json.loads((out / "decode.json").read_text())
    (res,) = run["results"]
    assert res["label"] == "test build" and "Note: test build." in (out / "decode.md").read_text()
    assert res["gpu"] == jax.devices()[0].device_kind and res["date"].endswith("UTC") and res["commit"]
    assert res["command"].startswith("python3 -m bench.decode --models smoke")
    assert set(res["methods"]) == {"w16a16", "w4a16", "w4a8", "qspec w4a8 g=3", "qspec w4a8/kv4 g=3",
                                   "qspec w4a8/head64q4 g=3"}
    q = res["methods"]["qspec w4a8 g=3"]
    assert abs(q["tokens_per_round"] - 16 / 6) < 1e-9  # 2 accepted + 1 per round: 16 tokens in 6 rounds
    assert q["iterations"] == 6 and q["tail"] == 1.0  # every sequence the same: no batch tail
    # 5 rounds commit 2 drafts + 1 each (15 tokens); the 6th has room for 1 token, which counts as
    # accepted (a draft) of the 2 it would accept: 11 of 6 x 3 drafts
    assert abs(q["alpha"] - 11 / 18) < 1e-12
    e_l = (1 - (11 / 18) ** 4) / (1 - 11 / 18)  # docs/design.md §2, gamma 3
    assert abs(q["model_speedup_alpha"] / q["model_speedup"] - e_l / q["tokens_per_round"]) < 1e-6  # float32
    shadow = res["methods"]["qspec w4a8/kv4 g=3"]  # its own trace: 1 accepted + 1 per round
    assert shadow["tokens_per_round"] == 2 and shadow["memory_bytes"] > q["memory_bytes"]  # the shadow's bytes
    assert shadow["draft_floor_ms"] <= q["draft_floor_ms"]  # a shadow draft reads fewer KV bytes
    head = res["methods"]["qspec w4a8/head64q4 g=3"]  # an INT4 head of 64 rows: fewer weight bytes, more memory
    assert head["tokens_per_round"] == 16 / 8 and head["memory_bytes"] > q["memory_bytes"]
    assert head["draft_floor_ms"] <= q["draft_floor_ms"] and head["verify_floor_ms"] == q["verify_floor_ms"]
    # phase floors: the byte floor, or the phase's matmul FLOPs at the rate measured in the run
    cfg = decode.MODELS["smoke"]
    params = decode.random_params(cfg, jax.random.key(0))  # 2 FLOPs per weight element of every matmul
    layer_weights = [params["layers"][blk][name]["w"] for blk, name in
                     (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))]
    elements = sum(w.packed.size * 2 for w in layer_weights) + params["lm_head"].size
    flops = 2 * elements
    assert decode.matmul_flops_per_token(cfg) == flops
    assert decode.matmul_flops_per_token(cfg, 64) == flops - 2 * (cfg.vocab_size - 64) * cfg.hidden_size
    rates = run["matmul_rates"]
    assert rates["bf16"] > 0 and rates["int8"] > 0
    assert q["verify_floor_ms"] == max(res["floor_ms_per_step"], 1e3 * 2 * 4 * flops / rates["bf16"])
    assert q["draft_floor_ms"] == max(res["floor_ms_per_step"], 1e3 * 2 * flops / rates["int8"])
    assert all(e["tokens_per_s"] > 0 for e in res["methods"].values())
    # memory per method: at least its weights (bf16 for W16A16, packed INT4 otherwise) and the KV cache
    nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
    for m, e in res["methods"].items():
        weights = nbytes(decode.float_params(params) if m == "w16a16" else params)
        assert e["memory_bytes"] >= weights + res["cache_bytes"], m
    assert "replayed" in (out / "decode.md").read_text()
    assert res["phase_context"] == 64 + 16 // 2  # the phases are timed where the floors are counted


def test_forward_carry_positions():
    """The timed forwards sit ``ahead`` positions past each sequence's committed tokens."""
    cfg = decode.MODELS["smoke"]
    state = decode.fresh_state(cfg, 3, 20, 8, 2, 0)
    toks, pos, cache = decode.forward_carry(state, 4, 5)
    lengths = jax.device_get(state.lengths)
    assert toks.shape == (3, 4) and cache is state.cache
    assert (jax.device_get(pos) == lengths[:, None] + 5 + np.arange(4)[None]).all()


def test_plot_series_and_file(tmp_path):
    """The plot takes the AR methods and QSPEC at the chosen gamma, per model, at one context."""
    def entry(model, batch, context, tps):
        return {"model": model, "batch": batch, "context": context, "methods": {
            "w4a16": {"tokens_per_s": tps}, "qspec w4a8 g=3": {"tokens_per_s": tps * 0.9},
            "qspec w4a8 g=1": {"tokens_per_s": 1.0}}}

    results = [entry("a", 8, 512, 100.0), entry("a", 16, 512, 180.0), entry("a", 8, 4096, 7.0),
               entry("b", 8, 512, 50.0), {"model": "b", "batch": 64, "context": 512, "skipped": "memory"},
               {**entry("a", 32, 512, 999.0), "disturbed": "timed beside a compile"}]
    data = plot.series(results, 512, 3)
    assert set(data) == {"a", "b"}
    assert data["a"]["w4a16"] == [(8, 100.0), (16, 180.0)]
    (qspec,) = [k for k in data["a"] if k.startswith("qspec")]
    assert "g=1" not in qspec and data["a"][qspec] == [(8, 90.0), (16, 162.0)]
    assert "replayed acceptance" in qspec  # a record without the field is a replayed (older) one
    real = {**entry("c", 8, 512, 40.0), "acceptance": "measured"}
    assert [k for k in plot.series([real], 512, 3)["c"] if k.startswith("qspec")] == [
        "qspec w4a8 draft, γ=3 (measured acceptance)"]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"results": results}))
    plot.main([str(run), "--out", str(tmp_path / "p.svg")])
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")
    # the HF baseline: its decode rate, at the chosen context, skipped rows left out
    hf_rows = [{"model": "a", "batch": 8, "context": 512, "decode_tokens_per_s": 30.0},
               {"model": "a", "batch": 8, "context": 4096, "decode_tokens_per_s": 3.0},
               {"model": "a", "batch": 16, "context": 512, "skipped": "out of GPU memory"}]
    assert plot.hf_series(hf_rows, 512) == {"a": {plot.HF_LABEL: [(8, 30.0)]}}
    for n in (3, 10, 11, 20):  # one colour per method in the legend, up to 20
        names = [f"m{i}" for i in range(n)]
        assert len(set(plot.colours(names).values())) == n
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps({"rows": hf_rows}))
    plot.main([str(run), "--hf", str(hf), "--out", str(tmp_path / "q.svg")])
    assert plot.HF_LABEL in (tmp_path / "q.svg").read_text()


def test_plot_refuses_sections_of_different_lengths():
    """Sections of different ``new`` at the plotted context are not drawn on one axis (their tokens/s
    average over different contexts); HF rows name their own length in the legend."""
    sec = {"model": "a", "batch": 8, "context": 512, "methods": {"w4a16": {"tokens_per_s": 1.0}}}
    assert plot.series([{**sec, "new": 512}, {**sec, "batch": 16, "new": 512}, {**sec, "context": 64, "new": 8}],
                       512, 3) == {"a": {"w4a16": [(8, 1.0), (16, 1.0)]}}
    with pytest.raises(SystemExit, match=r"different numbers of new tokens \(\[128, 512\]\)"):
        plot.series([{**sec, "new": 512}, {**sec, "batch": 16, "new": 128}], 512, 3)
    hf = plot.hf_series([{"model": "a", "batch": 8, "context": 512, "new": 128, "decode_tokens_per_s": 3.0}], 512)
    assert hf == {"a": {"HF transformers bf16 (decode rate, 128 new tokens)": [(8, 3.0)]}}


def test_decode_bench_two_configurations_in_one_call(tmp_path):
    """Two configurations in one call: each is measured with its own shapes (batch, context) and its
    own replayed accept decisions."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "constant test trace", "w4a8": {"1": [[1, 0, 1]]}}))
    decode.main(["--models", "smoke", "--contexts", "32,64", "--batches", "3", "--new", "8", "--gammas", "1",
                 "--drafts", "w4a8", "--ar", "w4a16", "--kernels", "reference", "--trace", str(trace),
                 "--out", str(tmp_path)])
    run = json.loads((tmp_path / "decode.json").read_text())
    res = run["results"]
    assert [(r["context"], r["batch"]) for r in res] == [(32, 3), (64, 3)]
    text = decode.markdown({**run, "results": [{**res[0], "disturbed": "timed beside a compile"}, res[1]]})
    assert text.count("**Not a valid measurement:** timed beside a compile") == 1
    for r in res:
        assert r["phase_context"] == r["context"] + 4
        assert set(r["methods"]) == {"w4a16", "qspec w4a8 g=1"}
        # the sequences accept 1, 0, 1 drafts per round: 8 tokens in 4, 8, 4 rounds, 16 / 3 on average
        q = r["methods"]["qspec w4a8 g=1"]
        assert abs(q["tokens_per_round"] - 8 / (16 / 3)) < 1e-9
        # the loop ran 8 iterations (the slowest sequence's rounds): a round's time is the loop's / 8
        assert q["iterations"] == 8 and abs(q["tail"] - 8 / (16 / 3)) < 1e-9
        loop_ms = 1e3 * 3 * 8 / q["tokens_per_s"]
        assert abs(q["ms_per_round"] - loop_ms / 8) < 1e-9 * loop_ms
        assert abs(q["overhead_ms"] - (q["ms_per_round"] - q["draft_ms"] - q["verify_ms"])) < 1e-9 * loop_ms
    assert res[1]["cache_bytes"] > res[0]["cache_bytes"]  # the longer context's own state
    assert all(r["bench_s"]["compile_wait"] >= 0 and r["bench_s"]["timing"] > 0 for r in res)
    assert (tmp_path / "decode.md").read_text().count("s waiting for compiles and") == 2


def test_decode_bench_out_of_memory_skips_the_configuration(tmp_path, monkeypatch):
    """A configuration none of whose methods fit at run time is recorded as skipped and the next one
    still runs; another runtime error still stops the run."""
    _fake_timing(monkeypatch)
    real = decode.run_config

    def oom_at_batch_2(c, *a, **k):
        if c.res["batch"] == 2:  # what run_config returns where every loop ran out of memory
            return {**c.res, "methods": {}, "not_run": {"w4a16": decode.OUT_OF_MEMORY}}
        return real(c, *a, **k)

    monkeypatch.setattr(decode, "run_config", oom_at_batch_2)
    common = [*SMOKE, *_trace(tmp_path)]
    decode.main([*common, "--batches", "2,3", "--out", str(tmp_path / "a")])
    res = json.loads((tmp_path / "a" / "decode.json").read_text())["results"]
    assert [(r["batch"], r.get("skipped"), r.get("skip_reason")) for r in res] == [
        (2, "out of GPU memory while timing", "memory"), (3, None, None)]
    assert "batch 2," not in (tmp_path / "a" / "decode.md").read_text()
    monkeypatch.setattr(decode, "run_config", lambda *a, **k: (_ for _ in ()).throw(
        jax.errors.JaxRuntimeError("INTERNAL: something else")))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        decode.main([*common, "--batches", "2", "--out", str(tmp_path / "b")])


def test_decode_bench_resume_and_budget(tmp_path, monkeypatch):
    """A second call with --resume keeps the first call's configuration and runs only the new one;
    a spent --budget-s starts nothing; --rerun measures a resumed configuration again."""
    _fake_timing(monkeypatch)
    common = [*SMOKE, *_trace(tmp_path)]
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    decode.main([*common, "--batches", "2", "--out", str(first)])
    decode.main([*common, "--batches", "2,3", "--resume", str(first / "decode.json"), "--out", str(second)])
    old = json.loads((first / "decode.json").read_text())["results"][0]
    res = json.loads((second / "decode.json").read_text())["results"]
    assert [r["batch"] for r in res] == [2, 3] and res[0] == old  # batch 2 kept as measured, not re-run
    decode.main([*common, "--batches", "4", "--budget-s", "1e-9", "--out", str(third)])
    assert json.loads((third / "decode.json").read_text())["results"] == []
    # --rerun: batch 2 measured again, replacing its old section in place; batch 3 kept
    fourth = tmp_path / "d"
    decode.main([*common, "--batches", "2", "--resume", str(second / "decode.json"), "--rerun", "--label", "again",
                 "--out", str(fourth)])
    res = json.loads((fourth / "decode.json").read_text())["results"]
    assert [(r["batch"], r.get("label")) for r in res] == [(2, "again"), (3, None)]
    # a --rerun that cannot run (budget spent; too large for the memory limit) keeps the old sections
    fifth, sixth = tmp_path / "e", tmp_path / "f"
    decode.main([*common, "--batches", "2,3", "--resume", str(fourth / "decode.json"), "--rerun", "--budget-s", "1e-9",
                 "--label", "lost", "--out", str(fifth)])
    assert json.loads((fifth / "decode.json").read_text())["results"] == res
    monkeypatch.setattr(decode, "MEM_LIMIT", 0.0)
    decode.main([*common, "--batches", "3", "--resume", str(fourth / "decode.json"), "--rerun", "--label", "lost",
                 "--out", str(sixth)])
    assert json.loads((sixth / "decode.json").read_text())["results"] == res


def test_budget_scales_the_estimate_by_the_slowest_measured_pace(monkeypatch):
    """--budget-s: a configuration starts only if its estimate times the pace ends in time; the pace is
    PACE until a configuration is measured, then the slowest measured / estimated ratio so far."""
    now = [100.0]
    monkeypatch.setattr(decode.time, "perf_counter", lambda: now[0])
    b = decode.Budget(deadline=110.0)
    assert b.pace() == decode.PACE and b.left() == 10.0
    fits = 10.0 / decode.PACE
    assert b.fits(fits * 0.99) and not b.fits(fits * 1.01)
    b.measured(1.0, 2.0)  # faster than the prior: the measured ratio replaces it
    assert b.pace() == 2.0 and b.fits(5.0) and not b.fits(5.01)
    b.measured(1.0, 5.0)  # a configuration took 5x its estimate
    assert b.pace() == 5.0 and b.fits(2.0) and not b.fits(2.01)
    b.measured(1.0, 0.5)  # a fast one does not lower it
    assert b.pace() == 5.0
    b.measured(0.0, 3.0)  # nor does one with no estimate (too large for memory) change it
    assert b.pace() == 5.0
    now[0] = 108.0
    assert b.left() == 2.0 and not b.fits(0.5)


def test_phase_check_flags_rounds_shorter_than_their_phases(monkeypatch):
    """A QSPEC round more than PHASE_SLACK shorter than its draft steps and verify (each timed alone)
    marks the section not valid; within the slack, or with no QSPEC rows, it stands."""
    monkeypatch.setattr(decode, "PHASE_SLACK", 0.05)

    def res(*overheads):
        return {"methods": {"w4a16": {"ms_per_step": 1.0}, **{
            f"qspec w4a8 g={i}": {"ms_per_round": 10.0, "overhead_ms": o} for i, o in enumerate(overheads)}}}

    assert decode.phase_check(res(0.3, -0.4)) is None
    assert decode.phase_check({"methods": {"w4a16": {"ms_per_step": 1.0}}}) is None
    reason = decode.phase_check(res(0.3, -0.6, -2.0))
    assert reason and "20%" in reason and "qspec w4a8 g=2" in reason


def test_decode_bench_leaves_out_a_draft_whose_shadow_does_not_fit(tmp_path, monkeypatch):
    """Where a draft's KV shadow does not fit beside the cache, its loops are left out (named, with the
    memory they need) and the other methods are still measured; a --resume counts the section as done;
    a limit below the autoregressive methods' own need skips the configuration."""
    _fake_timing(monkeypatch)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "constant test trace", "w4a8": {"1": [[0, 1]]}, "w4a8/kv8": {"1": [[0, 1]]}}))
    cfg, args = decode.MODELS["smoke"], decode.parse_args([*SMOKE, "--drafts", "w4a8,w4a8/kv8"])[0]
    weights = decode.weight_bytes(decode.random_params(cfg, jax.random.key(0)))
    need = {d: decode.memory_need(weights, cfg, 64, 2, type(args)(**{**vars(args), "drafts": [d]})) for d in args.drafts}
    kv = decode.kv_bytes(cfg, 2, 64 + 8 + 64)
    assert need["w4a8/kv8"] - need["w4a8"] == pytest.approx(kv * (8 / 16 + 1 / 32))  # codes and a scale per vector
    monkeypatch.setattr(decode, "MEM_LIMIT", (need["w4a8"] + need["w4a8/kv8"]) / 2)
    common = [*SMOKE, "--drafts", "w4a8,w4a8/kv8", "--batches", "2", "--trace", str(trace)]
    decode.main([*common, "--out", str(tmp_path / "a")])
    (res,) = json.loads((tmp_path / "a" / "decode.json").read_text())["results"]
    assert set(res["methods"]) == {"w4a16", "qspec w4a8 g=1"}
    assert set(res["not_run"]) == {"qspec w4a8/kv8 g=1"} and "more than the" in res["not_run"]["qspec w4a8/kv8 g=1"]
    assert "qspec w4a8/kv8 g=1 not measured: its draft needs ~" in (tmp_path / "a" / "decode.md").read_text()
    decode.main([*common, "--resume", str(tmp_path / "a" / "decode.json"), "--out", str(tmp_path / "b")])
    assert json.loads((tmp_path / "b" / "decode.json").read_text())["results"] == [res]  # done, not measured again
    monkeypatch.setattr(decode, "MEM_LIMIT", need["w4a8"] * 0.99)
    decode.main([*common, "--out", str(tmp_path / "c")])
    (skipped,) = json.loads((tmp_path / "c" / "decode.json").read_text())["results"]
    assert skipped["skip_reason"] == "memory"


def test_decode_bench_records_a_method_out_of_memory_and_runs_the_others(tmp_path, monkeypatch):
    """A decode loop that runs out of GPU memory is named in the section's ``not_run`` and the other
    methods of its configuration are still measured; where the W4A16 baseline itself does not fit, the
    QSPEC loops are timed without a speed-up; any other runtime error stops the run."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "constant test trace", "w4a8": {"1": [[0, 1]]}, "w4a8/kv8": {"1": [[0, 1]]}}))
    common = [*SMOKE, "--drafts", "w4a8,w4a8/kv8", "--batches", "2", "--trace", str(trace)]
    real, calls = decode.time_loop, []

    def failing(error: str, at: int):
        def time_loop(*a, **k):  # the loops run in order: w4a16, qspec w4a8, qspec w4a8/kv8
            calls.append(None)
            if len(calls) == at:
                raise jax.errors.JaxRuntimeError(f"{error}: Out of memory while trying to allocate 28.50GiB")
            return real(*a, **k)
        return time_loop

    monkeypatch.setattr(decode, "time_loop", failing("RESOURCE_EXHAUSTED", 3))
    decode.main([*common, "--out", str(tmp_path / "a")])
    (res,) = json.loads((tmp_path / "a" / "decode.json").read_text())["results"]
    assert set(res["methods"]) == {"w4a16", "qspec w4a8 g=1"} and "skipped" not in res
    assert res["not_run"] == {"qspec w4a8/kv8 g=1": decode.OUT_OF_MEMORY}
    assert "speedup_vs_w4a16" in res["methods"]["qspec w4a8 g=1"]
    assert f"qspec w4a8/kv8 g=1 not measured: {decode.OUT_OF_MEMORY}" in (tmp_path / "a" / "decode.md").read_text()
    calls.clear()
    monkeypatch.setattr(decode, "time_loop", failing("RESOURCE_EXHAUSTED", 1))
    decode.main([*common, "--out", str(tmp_path / "b")])
    (res,) = json.loads((tmp_path / "b" / "decode.json").read_text())["results"]
    assert set(res["methods"]) == {"qspec w4a8 g=1", "qspec w4a8/kv8 g=1"} and res["not_run"] == {
        "w4a16": decode.OUT_OF_MEMORY}
    assert not any("speedup_vs_w4a16" in e for e in res["methods"].values())
    calls.clear()
    monkeypatch.setattr(decode, "time_loop", failing("INTERNAL", 2))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        decode.main([*common, "--out", str(tmp_path / "c")])


def test_decode_bench_budget_does_not_start_what_would_not_end(tmp_path, monkeypatch):
    """A configuration whose scaled estimate exceeds what is left of --budget-s is not started (and
    leaves no section); with a larger budget it runs."""
    _fake_timing(monkeypatch)
    monkeypatch.setattr(decode, "config_cost_s", lambda *a: 1000.0)
    common = [*SMOKE, *_trace(tmp_path), "--batches", "2"]
    decode.main([*common, "--budget-s", str(900 * decode.PACE), "--out", str(tmp_path / "a")])
    assert json.loads((tmp_path / "a" / "decode.json").read_text())["results"] == []
    decode.main([*common, "--budget-s", str(1100 * decode.PACE), "--out", str(tmp_path / "b")])
    assert [r["batch"] for r in json.loads((tmp_path / "b" / "decode.json").read_text())["results"]] == [2]


def test_decode_bench_cheaper_configuration_after_one_that_does_not_fit(tmp_path, monkeypatch):
    """The budget skips a configuration that would not end in time and still runs a cheaper one after it."""
    _fake_timing(monkeypatch)
    monkeypatch.setattr(decode, "config_cost_s", lambda name, context, batch, *_: 1e6 if batch == 2 else 1e-3)
    decode.main([*SMOKE, *_trace(tmp_path), "--batches", "2,3", "--budget-s", "1000", "--out", str(tmp_path)])
    assert [r["batch"] for r in json.loads((tmp_path / "decode.json").read_text())["results"]] == [3]


def test_decode_bench_never_compiles_while_timing(tmp_path, monkeypatch):
    """Each configuration is compiled, then timed: no compile starts while a configuration is timed
    (a compile beside the timings slows them)."""
    events = []
    _fake_timing(monkeypatch, events)
    decode.main([*SMOKE, *_trace(tmp_path), "--batches", "2,3", "--out", str(tmp_path)])
    assert events == [("compile", 2, False), ("run", 2, True), ("compile", 3, False), ("run", 3, True)]


def test_decode_bench_resume_measures_a_disturbed_section_again(tmp_path, monkeypatch):
    """--resume keeps a measured section but measures one marked disturbed again (no --rerun needed)."""
    _fake_timing(monkeypatch)
    common = [*SMOKE, *_trace(tmp_path), "--batches", "2,3"]
    decode.main([*common, "--out", str(tmp_path / "a")])
    first = json.loads((tmp_path / "a" / "decode.json").read_text())
    first["results"][0]["disturbed"] = "timed beside a compile"
    (tmp_path / "a" / "decode.json").write_text(json.dumps(first))
    decode.main([*common, "--resume", str(tmp_path / "a" / "decode.json"), "--label", "again",
                 "--out", str(tmp_path / "b")])
    res = json.loads((tmp_path / "b" / "decode.json").read_text())["results"]
    assert [(r["batch"], r.get("label"), r.get("disturbed")) for r in res] == [(2, "again", None), (3, None, None)]
    assert res[1] == first["results"][1]


def test_decode_bench_resume_with_other_settings_measures_again(tmp_path, monkeypatch):
    """--resume keeps a section only if it holds what this run measures: another --new, the other
    kernels, or a gamma / draft / AR method it lacks measures the configuration again (logged); a
    section with more methods than asked for is kept."""
    _fake_timing(monkeypatch)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "t", "w4a8": {"1": [[0, 1]], "2": [[2]], "3": [[0]]}, "w4a4": {"1": [[1]]}}))
    common = ["--models", "smoke", "--contexts", "64", "--batches", "2", "--trace", str(trace)]
    first = tmp_path / "first" / "decode.json"
    decode.main([*common, "--new", "8", "--gammas", "1,2", "--drafts", "w4a8", "--ar", "w4a16,w4a8",
                 "--kernels", "reference", "--out", str(first.parent)])
    kept = json.loads(first.read_text())["results"]
    assert kept[0]["kernels"] == "reference"
    same = ["--new", "8", "--gammas", "1", "--drafts", "w4a8", "--ar", "w4a16", "--kernels", "reference"]
    decode.main([*common, *same, "--resume", str(first), "--out", str(tmp_path / "same")])
    assert json.loads((tmp_path / "same" / "decode.json").read_text())["results"] == kept  # a subset: kept
    logs = []
    monkeypatch.setattr(decode, "log", logs.append)
    for i, (flag, value, why) in enumerate([("--new", "16", "of 8 new tokens, not 16"),
                                            ("--kernels", "interpret", "of the reference kernels"),
                                            ("--gammas", "1,2,3", "without qspec w4a8 g=3"),
                                            ("--drafts", "w4a8,w4a4", "without qspec w4a4 g=1"),
                                            ("--ar", "w4a16,w4a4", "without w4a4")]):
        args = [*same[:same.index(flag)], flag, value, *same[same.index(flag) + 2:]]
        out = tmp_path / str(i)
        if flag == "--kernels":  # interpret-mode kernels are slow: only check that it would be measured
            monkeypatch.setattr(decode, "_bench_model", lambda name, todo, *a: logs.append(("todo", todo)))
        decode.main([*common, *args, "--resume", str(first), "--out", str(out)])
        assert any(why in str(line) for line in logs), (flag, logs)
        if flag == "--kernels":
            assert ("todo", [(64, 2)]) in logs
            monkeypatch.undo()
            _fake_timing(monkeypatch)
            monkeypatch.setattr(decode, "log", logs.append)
        else:
            (res,) = json.loads((out / "decode.json").read_text())["results"]
            assert res != kept[0] and res["new"] == int(args[args.index("--new") + 1])
        logs.clear()


def test_record_keeps_a_valid_section_over_a_skipped_or_disturbed_one():
    """A re-measured section replaces the old one in place, unless it was skipped, or disturbed while
    the old one is valid; a disturbed old one gives way to anything measured."""
    def sec(batch, **kw):
        return {"model": "m", "context": 64, "batch": batch, **kw}

    run = {"results": [sec(1, v=1), sec(2, v=1, disturbed="x")]}
    decode.record(run, sec(1, skipped="memory"))
    decode.record(run, sec(1, v=2, disturbed="y"))
    assert run["results"][0] == sec(1, v=1)
    decode.record(run, sec(2, v=2, disturbed="z"))  # disturbed over disturbed: the newer
    assert run["results"][1] == sec(2, v=2, disturbed="z")
    decode.record(run, sec(2, v=3))
    decode.record(run, sec(1, v=3))
    decode.record(run, sec(3, v=1, disturbed="w"))  # a new key is added whatever it is
    assert run["results"] == [sec(1, v=3), sec(2, v=3), sec(3, v=1, disturbed="w")]


def test_record_names_the_methods_a_rerun_drops(capsys):
    """A re-measured section of fewer methods replaces the old one whole, and the log says which."""
    old = {"model": "m", "context": 64, "batch": 1, "methods": {"w4a16": 1, "w16a16": 2, "qspec w4a8 g=1": 3}}
    run = {"results": [old]}
    decode.record(run, {**old, "methods": {"w4a16": 4}})
    assert run["results"][0]["methods"] == {"w4a16": 4}
    assert "dropped: qspec w4a8 g=1, w16a16" in capsys.readouterr().out
    decode.record(run, {**old, "methods": {"w4a16": 5, "w4a8": 6}})
    assert "dropped" not in capsys.readouterr().out


def test_decode_bench_real_model(tmp_path, monkeypatch):
    """The embedded SmolLM2 on few-shot prompts that fill the context, QSPEC with its own accept
    decisions (not replayed): each prompt fits the context and holds few-shot examples, the round
    count gives between 1 and gamma + 1 tokens per round."""
    monkeypatch.setattr(decode, "FORWARD_REPS", 2)  # phase loops of 2 forwards: SmolLM2 on the CPU is slow
    rows = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have now?",
             "answer": f"He has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}"} for i in range(40)]
    dev, train = tmp_path / "dev.jsonl", tmp_path / "train.jsonl"
    for path, part in ((dev, rows[:5]), (train, rows[5:])):
        path.write_text("\n".join(json.dumps(r) for r in part))
    out = tmp_path / "out"
    decode.main(["--models", "smollm2", "--gsm8k", str(dev), "--gsm8k-train", str(train), "--batches", "2",
                 "--contexts", "128", "--new", "8", "--gammas", "2", "--drafts", "w4a8", "--ar", "w4a16",
                 "--kernels", "reference", "--reps", "1", "--out", str(out)])
    (res,) = json.loads((out / "decode.json").read_text())["results"]
    assert res["acceptance"] == "measured" and 64 < res["prompt_tokens"] <= 128
    q = res["methods"]["qspec w4a8 g=2"]
    assert 1 <= q["tokens_per_round"] <= 3 and q["speedup_vs_w4a16"] > 0
    assert "(measured)" in (out / "decode.md").read_text()


def test_record_trace_on_the_real_model(tmp_path, capsys):
    """--record-trace: per-round accepted drafts of greedy QSPEC on SmolLM2, each in [0, gamma], no
    sequence committing more than --new tokens in the rounds kept."""
    dev = tmp_path / "dev.jsonl"
    dev.write_text("\n".join(json.dumps({"question": f"What is {i} plus {2 * i}?", "answer": f"#### {3 * i}"})
                             for i in range(3)))
    out = tmp_path / "trace.json"
    decode.main(["--record-trace", str(out), "--gsm8k", str(dev), "--prompts", "2", "--new", "8",
                 "--gammas", "2", "--drafts", "w4a8/headq4", "--kernels", "reference"])
    rounds = json.loads(out.read_text())["w4a8/headq4"]["2"]  # drafts from an INT4 copy of the head
    assert rounds and all(len(r) == 2 and all(0 <= a <= 2 for a in r) for r in rounds)
    for seq in zip(*rounds):
        assert sum(a + 1 for a in seq) <= 8
    with pytest.raises(SystemExit, match="no token ranking"):  # the embedded checkpoint has none
        decode.main(["--record-trace", str(out), "--gsm8k", str(dev), "--prompts", "1", "--new", "2",
                     "--gammas", "1", "--drafts", "w4a8/head64", "--kernels", "reference"])
    for bad in ("w4a16", "w4a8/kv2", "w4a8/int8", "w4a4/"):
        with pytest.raises(SystemExit):
            decode.main(["--drafts", bad, "--models", "smoke"])
        assert f"error: unknown draft '{bad}'" in capsys.readouterr().err  # not the missing --trace


def test_hf_baseline_arguments_and_report(tmp_path):
    """bench/hf_baseline.py without a GPU: unknown models and a missing torch / GPU are clear errors;
    the report gives decode ms per step as batch / decode rate and lists skipped configurations."""
    with pytest.raises(SystemExit, match="unknown models"):
        hf_baseline.main(["--models", "llama9-1t", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs"):
        hf_baseline.main(["--models", "smoke", "--out", str(tmp_path)])
    run = {"command": "c", "device": "d", "rows": [
        {"model": "llama3-8b", "batch": 8, "context": 512, "new": 128, "tokens_per_s": 700.0,
         "decode_tokens_per_s": 800.0},
        {"model": "llama2-13b", "batch": 64, "context": 3584, "new": 128, "skipped": "out of GPU memory"}]}
    md = hf_baseline.markdown(run)
    assert "| llama3-8b | 8 | 512 + 128 | 700 | 800 | 10.00 |" in md
    assert "| llama2-13b | 64 | 3584 + 128 | out of GPU memory | | |" in md


def test_time_loop_warms_up_on_a_nearly_finished_state():
    """The warm-up run gets a state with all but WARM_TOKENS of the new tokens counted as generated;
    every timed run gets a fresh state, and the last timed run's output is returned."""
    cfg = decode.MODELS["smoke"]
    seen = []

    def fake_loop(params, state):
        seen.append(int((state.lengths - state.prompt_lengths)[0]))
        return state

    make = lambda: decode.fresh_state(cfg, 2, 32, 16, 3, 0)  # noqa: E731
    secs, out = decode.time_loop(fake_loop, None, make, 16, reps=2)
    assert seen == [16 - decode.WARM_TOKENS, 0, 0]
    assert secs > 0 and int((out.lengths - out.prompt_lengths)[0]) == 0


def test_presets_expand_to_their_matrix():
    """--preset headline / full give the listed matrix; flags given explicitly override a preset's values."""
    args, _ = decode.parse_args(["--preset", "headline"])
    assert args.models == ["llama2-7b", "llama3-8b", "llama2-13b", "smollm2"]
    assert (args.batches, args.contexts, args.new, args.gammas) == ([1, 8, 16, 32], [512, 4096], 512, [1, 3])
    assert (args.ar, args.drafts, str(args.trace)) == (["w4a16", "w4a8"], ["w4a8/win1024+64"],
                                                        str(decode.CONTEXT_TRACE))  # generate()'s default draft
    assert args.real_contexts == [512] and args.auto
    args, _ = decode.parse_args(["--preset", "full"])
    assert args.models == ["llama3-8b", "llama2-7b", "llama2-13b", "llama2-70b", "smollm2"]
    assert (args.batches, args.contexts, args.gammas) == ([1, 8, 16, 32, 64], [512, 4096], [1, 3, 5])
    assert args.drafts == ["w4a8", "w4a4", "w4a8/kv8"] and args.ar == ["w16a16", "w4a16", "w4a8", "w4a4"]
    assert not args.auto
    args, explicit = decode.parse_args(["--preset", "headline", "--batches", "4", "--gammas=5", "--models", "smoke"])
    assert (args.batches, args.gammas, args.models, args.contexts) == ([4], [5], ["smoke"], [512, 4096])
    assert {"batches", "gammas", "models"} <= explicit and "contexts" not in explicit


def test_preset_leaves_out_smollm2_without_its_files(tmp_path, monkeypatch, capsys):
    """A preset drops SmolLM2 (saying why) where its GSM8K files are not found; --plan prints the matrix,
    what is too large for the card, and the estimated time, without measuring or writing anything."""
    monkeypatch.setattr(decode, "DATA_DIRS", (tmp_path / "nowhere",))
    decode.main(["--preset", "headline", "--plan", "h100", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "smollm2 left out of the headline preset: it needs --gsm8k and --gsm8k-train" in out
    assert "headline matrix on H100 (assumed): 24 configurations" in out and "estimated" in out
    assert "llama2-13b ctx=4096 B=32: too large: skipped" in out and "smollm2 ctx" not in out
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit, match="needs --gsm8k"):  # named explicitly: an error, not dropped
        decode.main(["--preset", "headline", "--models", "smollm2", "--plan", "h100"])


def test_smoke_preset_end_to_end_and_resume(tmp_path, monkeypatch, capsys):
    """The smoke preset measures a configuration on the CPU with the headline's methods, records
    where and what measured it, and lists skipped ones; a call stopped by its budget says how many
    configurations remain, and --resume finishes them."""
    out = tmp_path / "a"
    decode.main(["--preset", "smoke", "--contexts", "32", "--out", str(out)])
    run = json.loads((out / "decode.json").read_text())
    assert [(r["context"], r["batch"]) for r in run["results"]] == [(32, 2)]
    for r in run["results"]:
        draft = "qspec w4a8/win1024+64"
        assert set(r["methods"]) == {"w4a16", "w4a8", f"{draft} g=1", f"{draft} g=3", f"{draft} g=auto"}
        auto = r["methods"][f"{draft} g=auto"]
        assert 0 <= auto["mean_gamma"] <= decode.AUTO_GAMMA_MAX and auto["tokens_per_s"] > 0
        # against the W4A16 AR loop timed beside it, not the one timed first
        assert auto["speedup_vs_w4a16"] == pytest.approx(auto["tokens_per_s"] / auto["w4a16_tokens_per_s_beside"])
        # a window of 1088 slots over a 32-token context reads the whole cache: drafting gains nothing, so
        # the auto loop is W4A16's
        assert set(r["auto_best_gain"]) == {"w4a8/win1024+64"}
        assert r["auto_best_gain"]["w4a8/win1024+64"] <= 1 and auto["mean_gamma"] == 0
        assert {"gpu", "date", "commit", "command"} <= set(r)
    md = (out / "decode.md").read_text()
    assert "qspec w4a8/win1024+64 g=3" in md and "best γ (w4a8/win1024+64)" in md
    assert "timed alternately" in md and "W4A16 AR beside it" in md
    assert "(< 1 + MIN_GAIN: the W4A16 loop)" in md
    for e in run["results"][0]["methods"].values():  # a run recorded before auto was timed so says nothing of it
        e.pop("w4a16_tokens_per_s_beside", None)
    assert "alternately" not in decode.markdown(run)
    assert "0 of 1 configurations remain" in capsys.readouterr().out
    _fake_timing(monkeypatch)
    monkeypatch.setattr(decode, "config_cost_s", lambda name, context, batch, *_: 1e-3 if context == 32 else 1e6)
    monkeypatch.setattr(decode, "MEM_LIMIT", 1e12)
    decode.main(["--preset", "smoke", "--contexts", "32,64,128", "--budget-s", "1000",
                 "--out", str(tmp_path / "b")])
    assert [r["context"] for r in json.loads((tmp_path / "b" / "decode.json").read_text())["results"]] == [32]
    assert "2 of 3 configurations remain" in capsys.readouterr().out
    decode.main(["--preset", "smoke", "--contexts", "32,64,128", "--resume", str(tmp_path / "b" / "decode.json"),
                 "--out", str(tmp_path / "c")])
    res = json.loads((tmp_path / "c" / "decode.json").read_text())["results"]
    assert [r["context"] for r in res] == [32, 64, 128]
    assert "0 of 3 configurations remain" in capsys.readouterr().out
    monkeypatch.setattr(decode, "MEM_LIMIT", 0.0)  # a card too small for any: each one reported as skipped
    decode.main(["--preset", "smoke", "--out", str(tmp_path / "d")])
    assert "Not measured: smoke batch 2 context 32 (needs ~" in (tmp_path / "d" / "decode.md").read_text()


def test_cost_model_calibration_and_memory_limit(monkeypatch, rng):
    """The pace is recorded seconds / the cost model's estimate over recorded sections (median, largest);
    the memory limit is a share of the device's bytes_limit (none where the device reports none); a draft
    head's copy counts in the memory a configuration needs."""
    methods = {"w4a16": {}, "w4a8": {}, "qspec w4a8 g=1": {}, "qspec w4a8 g=3": {}, "qspec w4a8 g=auto": {}}
    args = decode.parse_args(["--preset", "headline", "--batches", "8", "--contexts", "512"])[0]
    est = decode.config_cost_s("llama3-8b", 512, 8, args, 4e12, float("inf"))
    assert est > decode.COMPILE_S * 9  # 5 loops and 4 phase programs compiled, then the loops' tokens
    sec = {"model": "llama3-8b", "context": 512, "batch": 8, "new": 512, "copy_bw": 4e12, "methods": methods}
    got = decode.calibrated_pace([{**sec, "bench_s": {"compile_wait": est, "timing": est}},
                                  {**sec, "bench_s": {"compile_wait": est, "timing": 2 * est}},
                                  {**sec, "bench_s": {"compile_wait": 0.0, "timing": 2 * est}}, sec])
    assert got == pytest.approx((2.0, 3.0))
    assert decode.calibrated_pace([sec]) is None
    cfg, rows = decode.MODELS["llama3-8b"], int(rng.integers(1, 100_000))
    plain = decode.memory_need(1e9, cfg, 512, 8, args)
    for draft, per_weight in ((f"w4a8/head{rows}q4", 0.5 + 8 / 32), (f"w4a8/head{rows}", 2)):
        got = decode.memory_need(1e9, cfg, 512, 8, type(args)(**dict(vars(args), drafts=[*args.drafts, draft])))
        assert got - plain == pytest.approx(rows * cfg.hidden_size * per_weight)
    fake = type("Device", (), {"memory_stats": lambda self: {"bytes_limit": 100e9}})()
    monkeypatch.setattr(decode.jax, "devices", lambda: [fake])
    assert decode.memory_limit() == pytest.approx(decode.MEM_HEADROOM * 100e9)
    fake.memory_stats = lambda: None
    assert decode.memory_limit() == float("inf")
    monkeypatch.setattr(decode, "MEM_LIMIT", 5.0)
    assert decode.memory_limit() == 5.0


def test_parse_draft_grammar(rng):
    """MODE[/kvBITS][/winSIZE[+SINKS]][/head[ROWS][q4]]: the old specs mean what they meant, a window's sinks default
    to DEFAULT_SINKS, and anything else is a ValueError that spells out the grammar."""
    from pallas_kernels.reference import AttentionWindow

    assert decode.parse_draft("w4a8") == decode.DraftSpec("w4a8", None, None)
    assert decode.parse_draft("w4a4/kv8") == decode.DraftSpec("w4a4", 8, None)
    assert decode.parse_draft("w4a8/kv4").kv == 4
    size, sinks = int(rng.integers(1, 5000)), int(rng.integers(0, 300))
    assert decode.parse_draft(f"w4a8/win{size}").window == AttentionWindow(decode.DEFAULT_SINKS, size)
    assert decode.parse_draft(f"w4a8/kv8/win{size}+{sinks}") == decode.DraftSpec("w4a8", 8, AttentionWindow(sinks, size))
    assert decode.parse_draft(f"w4a4/win{size}+{sinks}").window == AttentionWindow(sinks, size)
    assert decode.parse_draft("w4a16/kv8", ("w4a16",)).mode == "w4a16"  # bench.profile's modes
    rows = int(rng.integers(1, 50000))
    assert decode.parse_draft(f"w4a8/head{rows}") == decode.DraftSpec("w4a8", head_rows=rows)
    assert decode.parse_draft("w4a8/headq4") == decode.DraftSpec("w4a8", head_bits=4)
    spec = decode.parse_draft(f"w4a8/kv8/win{size}+{sinks}/head{rows}q4")
    assert spec == decode.DraftSpec("w4a8", 8, AttentionWindow(sinks, size), rows, 4) and spec.head
    assert not decode.parse_draft(f"w4a8/kv8/win{size}").head
    for bad in ("w4a9", "w4a8/", "w4a8/kv2", "w4a8/kv", "w4a8/win", "w4a8/win0", "w4a8/win-4", f"w4a8/win{size}+",
                "w4a8/win8+x", f"w4a8/win{size}/kv8", "w4a8/kv8/kv4", "w4a8/win8/win16", "w4a8/kv8/win8/x",
                "w4a8/int8", "w4a16", "w4a8/head", "w4a8/head0", "w4a8/headq8", "w4a8/head8/kv8"):
        with pytest.raises(ValueError, match=r"expected MODE\[/kvBITS\]\[/winSIZE\[\+SINKS\]\]\[/head"):
            decode.parse_draft(bad)
    with pytest.raises(SystemExit):  # two spellings of one draft would be compiled and timed twice
        decode.parse_args(["--drafts", f"w4a8/win{size},w4a8/win{size}+{decode.DEFAULT_SINKS}"])
    with pytest.raises(SystemExit, match="needs --trace"):  # random weights replay a trace's acceptance
        decode.main(["--drafts", "w4a8/headq4", "--models", "smoke"])


def test_trace_rows_picks_the_nearest_recorded_context(rng):
    """A per-context trace is replayed from the context nearest to the configuration's (the shorter
    on a tie); an old single-table trace is replayed as it is, at any context; a draft is found under
    any spelling of its spec."""
    recorded = sorted(rng.choice(np.arange(16, 8192), size=4, replace=False).tolist())
    trace = {"source": "s", "contexts": {str(c): {"prompt_tokens": c - 1.0, "w4a8": {"1": [[c]]}} for c in recorded}}
    for context in [*rng.integers(1, 9000, size=20).tolist(), *recorded]:
        at, table = decode.trace_rows(trace, context)
        assert abs(at - context) == min(abs(c - context) for c in recorded) and table["w4a8"]["1"] == [[at]]
    lo, hi = recorded[:2]
    if (hi - lo) % 2 == 0:
        assert decode.trace_rows(trace, (lo + hi) // 2)[0] == lo
    old = {"source": "s", "w4a8/win512+64": {"1": [[0]]}}
    assert decode.trace_rows(old, int(rng.integers(1, 9000))) == (None, old)
    assert decode.draft_rounds(old, "w4a8/win512") == {"1": [[0]]} and decode.draft_rounds(old, "w4a8") is None


def test_decode_bench_replays_each_context_from_its_nearest_trace(tmp_path):
    """Smoke model at contexts 32 and 64 against a trace recorded at 16 and 100: each section replays
    (and names) its nearest table, so its tokens per round are that table's; a windowed draft runs in
    the timed loops with a smaller draft floor; a draft or gamma the nearest table lacks stops the run
    before anything is timed, naming it."""
    tables = {"16": {"w4a8": {"1": [[0, 0]]}, "w4a8/win8+4": {"1": [[1, 0]]}},
              "100": {"w4a8": {"1": [[1, 1]]}, "w4a8/win8+4": {"1": [[0, 1]]}}}
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "per-context test trace", "contexts": tables}))
    out = tmp_path / "out"
    args = ["--models", "smoke", "--batches", "2", "--new", "8", "--gammas", "1", "--ar", "w4a16",
            "--kernels", "reference", "--trace", str(trace), "--out", str(out)]
    decode.main([*args, "--contexts", "32,64", "--drafts", "w4a8,w4a8/win8+4"])
    by_context = {r["context"]: r for r in json.loads((out / "decode.json").read_text())["results"]}
    assert by_context[32]["trace_context"] == 16 and by_context[64]["trace_context"] == 100
    assert by_context[32]["methods"]["qspec w4a8 g=1"]["tokens_per_round"] == 1
    assert by_context[64]["methods"]["qspec w4a8 g=1"]["tokens_per_round"] == 2
    # [0, 1]: one sequence 8 rounds of 1 token, the other 4 of 2, so 8 tokens in 6 rounds on average
    assert abs(by_context[64]["methods"]["qspec w4a8/win8+4 g=1"]["tokens_per_round"] - 8 / 6) < 1e-9
    for r in by_context.values():
        # the window's floor reads fewer KV bytes (equal where the FLOPs floor of a slow CPU is the larger)
        assert r["methods"]["qspec w4a8/win8+4 g=1"]["draft_floor_ms"] <= r["methods"]["qspec w4a8 g=1"]["draft_floor_ms"]
    assert "replayed from the trace recorded at context 100" in (out / "decode.md").read_text()
    tables["100"]["w4a8"]["2"] = [[1, 1]]
    trace.write_text(json.dumps({"source": "s", "contexts": tables}))
    with pytest.raises(SystemExit, match=r"no w4a8 rounds at context 16 \(the recorded context nearest to 32\) "
                                         r"for gamma \[2\]"):
        decode.main([*args, "--contexts", "32,64", "--gammas", "2", "--drafts", "w4a8"])
    with pytest.raises(SystemExit, match=r"no w4a8/kv8 rounds at context 100"):
        decode.main([*args, "--contexts", "64", "--drafts", "w4a8/kv8"])


def test_record_trace_per_context_on_the_real_model(tmp_path):
    """--record-trace --trace-contexts: one table per context on few-shot prompts that fit it (their
    mean length recorded), every draft spec x gamma with rounds in [0, gamma], the metadata, and the
    markdown summary; the shadow quantized from a plain prefill is the one a shadowed prefill makes."""
    rows = [{"question": f"Ann has {i} pens and buys {i + 2} more. How many pens does she have?",
             "answer": f"She has {i} + {i + 2} = {2 * i + 2} pens.\n#### {2 * i + 2}"} for i in range(30)]
    dev, train = tmp_path / "dev.jsonl", tmp_path / "train.jsonl"
    for path, part in ((dev, rows[:4]), (train, rows[4:])):
        path.write_text("\n".join(json.dumps(r) for r in part))
    out = tmp_path / "trace.json"
    decode.main(["--record-trace", str(out), "--trace-contexts", "96,192", "--gsm8k", str(dev), "--gsm8k-train",
                 str(train), "--prompts", "2", "--new", "6", "--gammas", "2", "--drafts", "w4a8/kv8/win16+4",
                 "--kernels", "reference"])
    doc = json.loads(out.read_text())
    assert doc["device"] == jax.devices()[0].device_kind and doc["date"].endswith("UTC") and doc["commit"]
    assert doc["command"].startswith("python3 -m bench.decode --record-trace")
    assert set(doc["contexts"]) == {"96", "192"}
    for context, table in doc["contexts"].items():
        assert 50 < table["prompt_tokens"] <= int(context)
        for draft in ("w4a8/kv8/win16+4",):
            rounds = table[draft]["2"]
            assert rounds and all(len(r) == 2 and all(0 <= a <= 2 for a in r) for r in rounds)
    assert doc["contexts"]["192"]["prompt_tokens"] > doc["contexts"]["96"]["prompt_tokens"]
    md = out.with_suffix(".md").read_text()
    assert "## Context 96 (prompts of" in md and "| draft | γ=2 |" in md
    mean = 1 + np.mean(doc["contexts"]["192"]["w4a8/kv8/win16+4"]["2"])
    assert f"{mean:.2f}" in md.split("## Context 192")[1].split("| w4a8/kv8/win16+4 |")[1].split("\n")[0]
    with pytest.raises(SystemExit, match="--trace-contexts needs --gsm8k-train"):
        decode.main(["--record-trace", str(out), "--trace-contexts", "96", "--gsm8k", str(dev)])

    model = decode.load(decode.default_checkpoint())
    ids = decode.fewshot_prompts(model, dev, train, 2, 96)
    rt = decode.Runtime(model.config, dtype=decode.jnp.float32, online_rotation_seed=model.checkpoint.online_rotation_seed,
                        execution=decode.Execution.decode("reference"))
    plain = decode.real_state_maker(model, rt, ids, 6, 2)()
    shadowed = decode.real_state_maker(model, decode.dataclasses.replace(rt, draft_kv=8), ids, 6, 2)()
    quantized = decode.with_shadow(plain, model.config, 8, max(len(p) for p in ids))
    for a, b in zip(jax.tree.leaves(shadowed.cache), jax.tree.leaves(quantized.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_trace_markdown_marks_what_a_context_lacks(rng):
    """The summary's tokens per round are 1 + the mean accepted count; a draft or gamma recorded at one
    context but not another reads "not recorded" there."""
    rounds = rng.integers(0, 4, size=(5, 3)).tolist()
    trace = {"device": "cpu", "kernels": "reference", "dtype": "float32", "command": "c",
             "contexts": {"512": {"prompt_tokens": 400.0, "w4a8": {"3": rounds}, "w4a8/win256+4": {"1": [[1]]}},
                          "3584": {"prompt_tokens": 3500.0, "w4a8": {"3": rounds}}}}
    md = decode.trace_markdown(trace)
    assert "CPU (float32 references)" in md
    long = md.split("## Context 3584")[1]
    assert f"| w4a8 | not recorded | {1 + np.mean(rounds):.2f} |" in long
    assert "| w4a8/win256+4 | not recorded | not recorded |" in long
