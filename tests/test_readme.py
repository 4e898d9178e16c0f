"""README.md's result tables are what ``python -m bench.report`` makes from the committed JSON files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parent.parent
MARKERS = ("decode", "decode-views", "kernels", "fidelity", "fidelity-window", "quality", "hf")


def test_readme_tables_match_the_committed_results():
    readme = (ROOT / "README.md").read_text()
    for name in MARKERS:
        assert f"<!-- results:{name} -->" in readme and f"<!-- /results:{name} -->" in readme, name
    generated = report.fill(readme, report.tables(ROOT / "bench" / "results"))
    assert generated == readme, "README.md's result tables are stale: run `python -m bench.report`"


def test_check_passes_on_the_committed_readme():
    assert report.main(["--check"]) == 0


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """A copy of the committed result JSON files, free to change."""
    out = tmp_path / "results"
    out.mkdir()
    for f in (ROOT / "bench" / "results").glob("*.json"):
        shutil.copy(f, out / f.name)
    return out


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("name, source, change", [
    ("decode", "decode.json",
     lambda d: d["results"][0]["methods"]["w4a16"].update(tokens_per_s=d["results"][0]["methods"]["w4a16"]
                                                          ["tokens_per_s"] * 2)),
    ("decode-views", "decode_views.json",
     lambda d: next(r for r in d["results"] if "methods" in r)["methods"]["w4a16"].update(tokens_per_s=1.0)),
    ("kernels", "kernels.json",
     lambda d: next(t for t in d["table"].values() if t["M"] == report.KERNEL_M
              and t["model"] == report.KERNEL_MODEL)["w4a16"].update(us=1234.5)),
    ("fidelity", "fidelity.json", lambda d: d["methods"]["qspec-w4a8"].update(identical=999)),
    ("quality", "quality.json", lambda d: next(iter(d["results"].values()))["ppl"].update(w4a16=99.0)),
    ("hf", "hf_baseline.json", lambda d: d["rows"][0].update(decode_tokens_per_s=1.0)),
])
def test_a_changed_result_changes_the_readme(results: Path, tmp_path: Path, capsys, name, source, change):
    """The check can fail: a changed number in any JSON changes its table, and ``--check`` then
    exits 1 with a diff."""
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    before = report.tables(results)
    _edit(results / source, change)
    after = report.tables(results)
    assert after[name] != before[name]
    assert report.main(["--check", "--readme", str(readme), "--results", str(results)]) == 1
    assert "+++ generated" in capsys.readouterr().out
    assert report.main(["--readme", str(readme), "--results", str(results)]) == 0
    assert report.main(["--check", "--readme", str(readme), "--results", str(results)]) == 0


def test_provenance_changes_the_caption(results: Path):
    _edit(results / "fidelity.json", lambda d: d.update(commit="abcdef0", date="2030-01-01"))
    text = report.tables(results)["fidelity"]
    assert "commit: abcdef0" in text and "date: 2030-01-01" in text


def test_decode_with_some_configurations(results: Path):
    """A decode run of one configuration, with one draft and one gamma, gives one table of one row;
    an empty or absent one a line saying so."""
    section = {"model": "llama3-8b", "batch": 8, "context": 4096, "new": 512, "acceptance": "replayed",
               "methods": {"w4a16": {"tokens_per_s": 2000.0, "ms_per_step": 4.0},
                           "qspec w4a8 g=3": {"tokens_per_s": 2500.0, "ms_per_round": 12.0}}}
    (results / "decode.json").write_text(json.dumps({"device": "NVIDIA H200", "results": [section]}))
    text = report.tables(results)["decode"]
    assert text.count("**Llama-3-8B, context 4096 + 512 new tokens**") == 1 and text.count("**") == 2
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| batch")]
    assert rows == ["| 8 | 2000 | 2500 (1.25×, γ=3) |"]
    assert "date: not recorded" in text and "commit: not recorded" in text
    _edit(results / "decode.json", lambda d: d.update(results=[]))
    assert "No decode configuration" in report.tables(results)["decode"]
    (results / "decode.json").unlink()
    assert "not present" in report.tables(results)["decode"]


def test_decode_auto_gamma_column(results: Path):
    """A gamma="auto" entry gets its own column (speed-up and mean γ); it is never taken as a fixed γ."""
    section = {"model": "llama3-8b", "batch": 8, "context": 512, "new": 512, "acceptance": "replayed",
               "methods": {"w4a16": {"tokens_per_s": 2000.0, "ms_per_step": 4.0},
                           "qspec w4a8 g=1": {"tokens_per_s": 1800.0, "ms_per_round": 12.0},
                           "qspec w4a8 g=auto": {"tokens_per_s": 2100.0, "mean_gamma": 0.25}}}
    (results / "decode.json").write_text(json.dumps({"device": "NVIDIA H200", "results": [section]}))
    text = report.tables(results)["decode"]
    assert "| batch | W4A16 AR | QSPEC, W4A8 draft | QSPEC, W4A8 draft, γ auto |" in text
    assert "| 8 | 2000 | 1800 (0.90×, γ=1) | 2100 (1.05×, mean γ 0.2) |" in text and "γ auto:" in text


def test_decode_sections_without_a_row_are_named(results: Path):
    """A configuration skipped for memory or timed while disturbed gets no row, and the table says so;
    a run of two calls is captioned as one further call."""
    measured = {"model": "llama3-8b", "batch": 8, "context": 512, "new": 512,
                "methods": {"w4a16": {"tokens_per_s": 2000.0, "ms_per_step": 4.0}}}
    runs = [{**measured, "batch": 32, "context": 4096, "skipped": "needs ~121 GB, more than the 70 GB it may use",
             "skip_reason": "memory"},
            {**measured, "batch": 16, "disturbed": "a QSPEC round came out 7% shorter than its phases"},
            {**measured, "batch": 1, "disturbed": "a QSPEC round came out 5% shorter than its phases"}]
    (results / "decode.json").write_text(json.dumps({"device": "NVIDIA H100", "command": "a; then b",
                                                      "results": [measured, *runs]}))
    text = report.tables(results)["decode"]
    assert "| 8 | 2000 |" in text and "| 16 |" not in text and "| 1 |" not in text
    assert ("Llama-3-8B batch 1, 16 at context 512: its timing was disturbed" in text
            and "Llama-3-8B batch 32 at context 4096: more memory than the card has" in text)
    assert "`a` and 1 further call." in text


def test_marker_without_its_end_is_refused():
    with pytest.raises(SystemExit, match="no <!-- /results:decode -->"):
        report.fill("<!-- results:decode -->\nold\n", {"decode": "new"})
    with pytest.raises(SystemExit, match="no such table"):
        report.fill("<!-- results:nope -->\n<!-- /results:nope -->\n", {"decode": "new"})


def test_decode_caption_from_per_section_metadata(results: Path):
    """Runs that record the GPU, date and commit per section are captioned from them."""
    def stamp(d):
        d.pop("date", None)
        for i, r in enumerate(d["results"]):
            r.pop("label", None)
            r.update(gpu="NVIDIA H100 80GB HBM3", date=f"2026-12-0{5 + i % 2} 10:00 UTC", commit="1234abc")
    _edit(results / "decode.json", stamp)
    first = report.tables(results)["decode"].splitlines()[0]
    assert first.startswith("*NVIDIA H100 80GB HBM3; date: 2026-12-05 to 2026-12-06; commit: 1234abc;"), first


def test_method_names_of_draft_specs():
    """A draft spec's views of the KV cache, spelled out in the tables' headers."""
    assert report.method_name("w4a16") == "W4A16"
    assert report.method_name("w4a8/kv8") == "W4A8 + INT8 KV"
    assert report.method_name("w4a8/win1024") == "W4A8 + window 1024"
    assert report.method_name("w4a4/kv4/win512+4") == "W4A4 + INT4 KV + window 512 (4 sinks)"


def test_hf_ratio_only_on_the_same_gpu(results: Path):
    """qspec-jax's W4A16 speed sits next to the Hugging Face baseline only when both ran on one GPU."""
    hf = json.loads((results / "hf_baseline.json").read_text())
    row = hf["rows"][0]
    decode = {"results": [{"model": row["model"], "batch": row["batch"], "context": row["context"], "gpu": "GPU A",
                           "methods": {"w4a16": {"tokens_per_s": 2.0 * row["decode_tokens_per_s"]}}}]}
    (results / "decode.json").write_text(json.dumps(decode))
    for gpu, shown in (("GPU A", True), ("GPU B", False)):
        _edit(results / "hf_baseline.json", lambda d: d.update(device=gpu))
        start = f"| {report.model_name(row['model'])} | {row['batch']} |"
        line = next(x for x in report.tables(results)["hf"].splitlines() if x.startswith(start))
        assert ("2.00×" in line) is shown, line
