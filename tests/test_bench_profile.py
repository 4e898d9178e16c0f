"""bench/profile.py: the trace summary on a synthetic Perfetto trace (GPU and host events), and the
clear error on a machine without a GPU."""

from __future__ import annotations

import jax
import pytest

from bench import profile


def _trace():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    gpu = [("_w4a16_kernel__2", 30.0), ("_w4a16_kernel__2", 26.0), ("_attention_kernel", 9.0),
           ("_rms_norm_kernel", 3.0), ("_rms_norm_kernel", 3.0), ("memcpy128", 4.0), ("loop_add_fusion", 2.0),
           ("_dense_kernel", 250.0), ("_swiglu_absmax_kernel", 2.0), ("_swiglu_codes_kernel", 2.0),
           ("_prologue_kernel__1", 4.0), ("_merge_absmax_kernel", 1.0), ("_merge_codes_kernel", 1.0)]
    events = [{"ph": "X", "pid": 1, "name": n, "dur": d} for n, d in gpu]
    events[2]["args"] = {"registers_per_thread": "90", "grid_x": "16", "correlation_id": "7"}
    events += [{"ph": "X", "pid": 2, "name": "_w4a16_kernel__2", "dur": 1000.0}]  # host side: ignored
    return {"traceEvents": meta + events}


def test_summary_of_a_trace():
    us, count, launch = profile.gpu_kernel_times(_trace())
    assert us["_w4a16_kernel__2"] == 56.0 and count["_w4a16_kernel__2"] == 2
    assert launch["_attention_kernel"] == {"registers_per_thread": "90", "grid_x": "16"}  # launch facts only
    assert launch["_rms_norm_kernel"] == {}
    s = profile.summarize(us, count, launch, reps=2)
    assert s["total_us"] == pytest.approx(337.0 / 2)
    assert s["categories"] == pytest.approx({"W4A16 matmul": 28.0, "attention": 4.5, "RMSNorm": 3.0, "copies": 2.0,
                                             "other XLA ops": 1.0, "lm_head (dense)": 125.0,
                                             "activation prologue": 4.0, "attention merge prologue": 1.0})
    assert [k["name"] for k in s["kernels"]][:2] == ["_dense_kernel", "_w4a16_kernel__2"]
    assert s["kernels"][1]["calls"] == 1.0
    text = profile.markdown({"device": "test", "command": "x", "model": "m", "batch": 8, "context": 512, "reps": 2,
                             "runs": {"w4a16, 1 token(s) per sequence": s}})
    assert "| lm_head (dense) | 125.0 | 74% |" in text  # 125 of 168.5
    assert "| `_attention_kernel` | 4.5 | 0.5 | registers_per_thread 90, grid_x 16 |" in text


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error without a GPU")
def test_no_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="needs a GPU"):
        profile.main(["--model", "smoke", "--batch", "2", "--context", "32", "--runs", "w4a16:1", "--reps", "2",
                      "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs a GPU"):  # a shadow draft run gets as far as the trace
        profile.main(["--model", "smoke", "--batch", "2", "--context", "32", "--runs", "w4a8/kv4:1", "--reps", "2",
                      "--out", str(tmp_path)])
    for bad in ("w4a16", "w4a8/kv2:1", "w8a8:1", "w4a8/int8:1"):
        with pytest.raises(SystemExit):
            profile.main(["--model", "smoke", "--runs", bad])
