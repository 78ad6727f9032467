"""benchmarks/trace_report.py charges each kernel of a profiled step to the phase, module or autograd node and op
whose launch it came from (a synthetic chrome trace: the profiler's event kinds and fields)."""

from benchmarks.trace_report import attribute, report


def _range(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def _launch(corr, ts, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "args": {"correlation": corr}}


def _kernel(name, corr, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": 1000 + corr, "dur": dur, "tid": 7,
            "args": {"correlation": corr}}


def test_kernels_are_charged_to_their_phase_owner_and_op():
    events = [
        _range("fwd::KimiDeltaAttention", 0, 100, cat="user_annotation"), _range("aten::mm", 10, 20),
        _launch(1, 15), _kernel("gemm_a", 1, 30.0),
        _launch(2, 50), _kernel("elementwise", 2, 5.0),  # in the module, under no op
        _range("autograd::engine::evaluate_function: MmBackward0", 200, 50, tid=2), _range("aten::mm", 210, 20, tid=2),
        _launch(3, 215, tid=2), _kernel("gemm_b", 3, 60.0),
        _range("Optimizer.step#Muon.step", 300, 100), _range("aten::bmm", 310, 10), _launch(4, 312),
        _kernel("gemm_c", 4, 10.0),
        _launch(5, 500), _kernel("stray", 5, 1.0),  # outside every range
    ]
    rows = {r[0]: r[1:] for r in attribute(events)}
    assert rows["gemm_a"] == (30.0, "forward", "KimiDeltaAttention", "aten::mm")
    assert rows["elementwise"][1:3] == ("forward", "KimiDeltaAttention")
    assert rows["gemm_b"] == (60.0, "backward", "MmBackward0", "aten::mm")
    assert rows["gemm_c"] == (10.0, "optimizer", "Optimizer.step#Muon.step", "aten::bmm")
    assert rows["stray"][1:3] == ("forward", "outside modules")
    text = report(attribute(events), steps=1, top=10)
    assert "device time per step: 0.11 ms in 5 kernels/copies" in text
    assert "backward" in text.splitlines()[3]  # the largest phase first (60 of 106 us)
