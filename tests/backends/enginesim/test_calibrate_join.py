"""The join window (backends/enginesim/calibrate/joining.py, Calibration.join_window_s): its estimate from pairs
of known first-token gaps, the fit and the file that carry it, and engine-sim's rule: an idle instance's first
step takes what reaches it within the window, and a lone request's TTFT is the same with or without one.
Synthetic gaps and terms; no timing of this machine is asserted."""

from __future__ import annotations

import tomllib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kvbench.backends.enginesim import calibrate as C
from kvbench.backends.enginesim.roofline import Calibration

from kvbench.errors import KvbenchError
from tests.backends.enginesim.test_calibrate import CHUNK, TRUTH, _true_s, synthetic

LONE = 0.1  # seconds: a lone prefill of the pair's prompt
TOKENS = 512


def pairs(offset_ms: float, joined: int, apart: int) -> C.JoinPoint:
    """Pairs sent `offset_ms` apart: `joined` of them gave both first tokens 1 ms apart, `apart` a prefill apart."""
    gaps = [0.001] * joined + [LONE] * apart
    return C.JoinPoint(offset_ms / 1e3, TOKENS, gaps, [0.12] * len(gaps))


def test_the_window_is_where_most_pairs_stop_joining():
    points = [pairs(10, 0, 3), pairs(0, 3, 0), pairs(2, 3, 0), pairs(5, 1, 2)]  # (any order)
    window, warnings = C.join_window(points, LONE, request_overhead_s=0.05)
    assert window == pytest.approx(0.0035) and warnings == []  # midway between 2 ms (joined) and 5 ms (not)


def test_pairs_sent_together_that_do_not_join_give_no_window():
    assert C.join_window([pairs(0, 1, 2), pairs(2, 3, 0)], LONE, 0.05) == (0.0, [])  # (a later join is noise)
    assert C.join_window([pairs(0, 2, 2)], LONE, 0.05)[0] == 0.0  # half is not most
    assert C.join_window([], LONE, 0.05) == (0.0, [])


def test_joining_at_every_offset_says_to_measure_further():
    window, warnings = C.join_window([pairs(0, 3, 0), pairs(4, 2, 1)], LONE, 0.05)
    assert window == pytest.approx(0.004) and "larger --join-offsets" in warnings[0]


def test_the_window_is_capped_at_the_request_overhead_it_is_part_of():
    window, warnings = C.join_window([pairs(0, 3, 0), pairs(20, 3, 0), pairs(40, 0, 3)], LONE, 0.012)
    assert window == 0.012 and "capped" in warnings[0]
    with pytest.raises(KvbenchError, match="join_window_s"):
        Calibration(request_overhead_s=0.01, join_window_s=0.02)


def _result_with_pairs():
    result = synthetic()
    result.plan.join_tokens = TOKENS
    lone = _true_s(C.prefill_row(TOKENS, 0, CHUNK), TRUTH) - TRUTH["request_overhead_s"]
    gap_apart = lone * 0.9  # a second prefill, less a little
    result.join = [
        C.JoinPoint(0.0, TOKENS, [0.0005, 0.001, gap_apart], [0.1] * 3),
        C.JoinPoint(0.002, TOKENS, [0.001, 0.002, 0.0015], [0.1] * 3),
        C.JoinPoint(0.008, TOKENS, [gap_apart, 0.001, gap_apart], [0.1] * 3),
    ]
    return result, lone


def test_the_fit_judges_pairs_by_its_own_lone_prefill_and_the_file_keeps_them(tmp_path):
    result, lone = _result_with_pairs()
    cal = C.fit(result)
    assert cal.join_lone_prefill_s == pytest.approx(lone, rel=1e-5)
    assert cal.calibration()["join_window_s"] == pytest.approx(0.005)  # 2 ms joined, 8 ms did not
    path = C.write(tmp_path / "calib.toml", result, cal)
    data = tomllib.loads(path.read_text())
    assert data["calibration"]["join_window_s"] == pytest.approx(0.005)
    assert [(j["offset_s"], j["joined"], j["pairs"]) for j in data["measurements"]["join"]] == [
        (0.0, 2, 3),
        (0.002, 3, 3),
        (0.008, 1, 3),
    ]
    assert Calibration.from_mapping(data["calibration"], str(path)).join_window_s == pytest.approx(0.005)


def _replay(tmp_path, name: str, arrivals: list[float], window: float) -> list[float]:
    """TTFTs engine-sim gives requests of TOKENS fresh tokens sent at `arrivals`, under TRUTH's terms and
    `window`."""
    from kvbench.run.runner import run_replay
    from kvbench.trace.files import new_meta, write_trace

    calib = tmp_path / f"{name}.toml"
    terms = {**TRUTH, "join_window_s": window}
    calib.write_text("[calibration]\n" + "".join(f"{k} = {v!r}\n" for k, v in terms.items()))
    rows = [
        {
            "request_id": f"r{i}",
            "arrival_s": t,
            "input_tokens": TOKENS,
            "output_tokens": 2,
            "block_hashes": [1000 * (i + 1) + b for b in range(TOKENS // 16)],
        }
        for i, t in enumerate(arrivals)
    ]
    trace = tmp_path / f"{name}.parquet"
    write_trace(pa.Table.from_pylist(rows), trace, new_meta(16, {"test": "join"}))
    opts = {"hardware": "cpu", "model": "kvbench-tiny", "max_num_batched_tokens": CHUNK, "calibration": str(calib)}
    run_dir, _ = run_replay(trace, "engine-sim", {**opts, "policy": "lru"}, out=tmp_path / name, report=False)
    return pq.read_table(run_dir / "requests.parquet").to_pydict()["ttft_s"]


def test_engine_sim_prefills_a_request_inside_the_window_with_the_first(tmp_path):
    window = 0.005
    lone = _true_s(C.prefill_row(TOKENS, 0, CHUNK), TRUTH)
    (alone,) = _replay(tmp_path, "alone", [0.0], window)
    assert alone == pytest.approx(lone, rel=1e-6)  # the window is part of the overhead a lone TTFT holds
    (no_window,) = _replay(tmp_path, "alone0", [0.0], 0.0)
    assert no_window == pytest.approx(alone, rel=1e-9)
    a, b = _replay(tmp_path, "inside", [0.0, 0.002], window)
    assert a > lone and b == pytest.approx(a - 0.002, abs=1e-9)  # one step for both: first tokens together
    a, b = _replay(tmp_path, "outside", [0.0, 0.008], window)
    assert a == pytest.approx(lone, rel=1e-6) and b + 0.008 > a + 0.5 * (lone - TRUTH["request_overhead_s"])
    a, b = _replay(tmp_path, "nowindow", [0.0, 0.002], 0.0)  # without a window the second waits for a step
    assert a == pytest.approx(lone, rel=1e-6) and b + 0.002 > a
