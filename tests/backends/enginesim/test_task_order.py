"""--task-order: the waiting queue ordered by task, checked on a hand-built agent trace whose admissions and task
completion times follow from a step model a reader can run in their head (docs/task-scheduling.md).

The model: a calibration whose only term is `step_overhead_s = 1`, so every engine iteration takes 1 s whatever
it holds; one sequence at a time (--max-num-seqs 1), prompts far below the token budget. A call with k output
tokens then runs k iterations, k seconds: its prefill iteration samples the first token, k - 1 decodes follow.

Three tasks (session_id), each call of a task waiting for the previous one (closed loop) plus 0.5 s think time:

    call  task  trace arrival  prompt  output  runs
    a0    A     0.0            8       1       1 s
    b0    B     0.1            40      3       3 s
    c0    C     0.2            8       2       2 s
    a1    A     after a0       100     1       1 s
    c1    C     after c0       8       2       2 s

a0 starts at 0 and ends at 1; a1 arrives at 1.5. At 1 the queue holds b0 and c0, and the policies part ways."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbench.errors import KvbenchError
from kvbench.run.runner import run_replay
from kvbench.trace.files import TraceMeta, write_trace
from kvbench.trace.schema import conform

BS = 4
CALLS = ["a0", "b0", "c0", "a1", "c1"]
PROMPT = {"a0": 8, "b0": 40, "c0": 8, "a1": 100, "c1": 8}
OUTPUT = {"a0": 1, "b0": 3, "c0": 2, "a1": 1, "c1": 2}
TASK_ARRIVAL = {"A": 0.0, "B": 0.1, "C": 0.2}  # of each task's first call

# (start, finish) of every call under each order, worked out by hand from the table above:
EXPECTED = {
    # 1: b0 (arrived first) runs 1-4; 4: c0 (arrived 0.2) before a1 (1.5), 4-6; a1 6-7; c1 (6.5) 7-9
    "fcfs": {"a0": (0, 1), "b0": (1, 4), "c0": (4, 6), "a1": (6, 7), "c1": (7, 9)},
    # 1: tasks B (0.1) before C (0.2): b0 1-4; 4: task A (0.0) before C: a1 4-5; c0 5-7; queue empty until
    # c1 arrives at 7.5, 7.5-9.5
    "oldest-task": {"a0": (0, 1), "b0": (1, 4), "c0": (5, 7), "a1": (4, 5), "c1": (7.5, 9.5)},
    # 1: B has 1 call left, C 2: b0 1-4; 4: A has 1 left, C 2: a1 4-5; then as oldest-task
    "fewest-remaining-calls": {"a0": (0, 1), "b0": (1, 4), "c0": (5, 7), "a1": (4, 5), "c1": (7.5, 9.5)},
    # tokens left: 1: B 40+3 = 43, C (8+2)+(8+2) = 20: c0 1-3 (c1 due 3.5); 3: B 43, A 100+1 = 101: b0 3-6;
    # 6: C 10 before A 101: c1 6-8; a1 8-9
    "least-remaining-work": {"a0": (0, 1), "b0": (3, 6), "c0": (1, 3), "a1": (8, 9), "c1": (6, 8)},
    # seconds run by finished calls: 1: B 0 and C 0 tie, b0 arrived first: 1-4; 4: C 0 before A 1 (a0 ran 0-1):
    # c0 4-6; a1 6-7; c1 7-9 (as fcfs here: the task that already ran goes last, and it was last anyway)
    "least-attained-service": {"a0": (0, 1), "b0": (1, 4), "c0": (4, 6), "a1": (6, 7), "c1": (7, 9)},
}


def agent_trace(path) -> str:
    task = {c: c[0].upper() for c in CALLS}
    cols = {
        "request_id": CALLS,
        "arrival_s": [0.0, 0.1, 0.2, 0.3, 0.4],  # a1 and c1: their closed-loop arrival comes later
        "input_tokens": [PROMPT[c] for c in CALLS],
        "output_tokens": [OUTPUT[c] for c in CALLS],
        # no block shared between calls: no hit shortens a prefill (and at 1 s a step none would)
        "block_hashes": pa.array(
            [list(range(100 * i, 100 * i + -(-PROMPT[c] // BS))) for i, c in enumerate(CALLS)], pa.list_(pa.uint64())
        ),
        "workload": ["agent"] * 5,
        "session_id": [f"task-{task[c]}" for c in CALLS],
        "parent_id": [None, None, None, "a0", "c0"],
        "depends_on": [[], [], [], ["a0"], ["c0"]],
        "think_time_s": [0.0, 0.0, 0.0, 0.5, 0.5],
    }
    table = conform(pa.table(cols))
    write_trace(table, path, TraceMeta(block_size=BS, source={"test": "task order"}, created="test"))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("task-order")
    calib = tmp / "one-second-steps.toml"
    calib.write_text("[calibration]\nstep_overhead_s = 1.0\n")
    return agent_trace(tmp / "agent5.parquet"), calib, tmp


def replay(setup, name, **opts):
    trace, calib, tmp = setup
    opts = {"calibration": str(calib), "max_num_seqs": 1, "closed_loop": True} | opts
    run_dir, summary = run_replay(trace, "engine-sim", opts, out=tmp / name, report=False)
    rows = pq.read_table(run_dir / "requests.parquet")
    return rows, summary["points"][0]


def starts_and_finishes(rows) -> dict[str, tuple[float, float]]:
    """Each call's (start, finish) from requests.parquet: its send (closed loop: when it arrived) plus its queue
    wait, and plus its end-to-end latency."""
    sent, queue, e2el = (rows.column(c).to_pylist() for c in ("actual_send_s", "queue_s", "e2el_s"))
    ids = rows.column("request_id").to_pylist()
    return {c: (round(sent[i] + queue[i], 6), round(sent[i] + e2el[i], 6)) for i, c in enumerate(ids)}


@pytest.mark.parametrize("order", list(EXPECTED))
def test_each_order_admits_calls_as_worked_out_by_hand(setup, order):
    rows, point = replay(setup, order, task_order=order)
    assert starts_and_finishes(rows) == {c: (float(s), float(f)) for c, (s, f) in EXPECTED[order].items()}
    facts = point["engine"]["scenarios"]["agent-tasks"]
    # a task's completion: its last call's finish less its first call's arrival
    done = {t: max(f for c, (_, f) in EXPECTED[order].items() if c[0].upper() == t) - TASK_ARRIVAL[t] for t in "ABC"}
    assert facts["task_order"] == order and facts["tasks"] == 3
    assert facts["completion_s"]["mean"] == pytest.approx(np.mean(list(done.values())), abs=1e-9)
    assert facts["completion_s"]["max"] == pytest.approx(max(done.values()), abs=1e-9)
    assert facts["completion_s"]["p50"] == pytest.approx(np.median(list(done.values())), abs=1e-9)
    # each call's TTFT: its first token comes 1 s after it starts; it arrived at its trace time (a root) or
    # 0.5 s after its predecessor finished
    times = EXPECTED[order]
    arrived = {"a0": 0.0, "b0": 0.1, "c0": 0.2, "a1": times["a0"][1] + 0.5, "c1": times["c0"][1] + 0.5}
    ttft = [times[c][0] + 1 - arrived[c] for c in CALLS]
    assert facts["call_ttft_s"]["mean"] == pytest.approx(np.mean(ttft), abs=1e-9)
    assert facts["call_ttft_s"]["max"] == pytest.approx(max(ttft), abs=1e-9)
    # peak KV of a task graph: its calls run one after another, so the largest call's blocks of 4 tokens:
    # A max(⌈9/4⌉, ⌈101/4⌉) = 26, B ⌈43/4⌉ = 11, C ⌈10/4⌉ = 3 blocks (the same under every order)
    peak = facts["peak_kv_bytes_per_task"]
    assert peak["max"] / peak["p50"] == pytest.approx(26 / 11) and peak["mean"] / peak["p50"] == pytest.approx(40 / 33)


def test_finishing_short_tasks_first_shortens_the_mean_task(setup):
    """fcfs: A 7, B 3.9, C 8.8 (mean 6.567 s); fewest-remaining-calls: A 5, B 3.9, C 9.3 (mean 6.067 s)."""
    fcfs = replay(setup, "fcfs-mean", task_order="fcfs")[1]["engine"]["scenarios"]["agent-tasks"]
    short = replay(setup, "frc-mean", task_order="fewest-remaining-calls")[1]["engine"]["scenarios"]["agent-tasks"]
    assert fcfs["completion_s"]["mean"] == pytest.approx((7 + 3.9 + 8.8) / 3)
    assert short["completion_s"]["mean"] == pytest.approx((5 + 3.9 + 9.3) / 3)


def same_rows(a, b) -> bool:
    """Two requests tables equal cell by cell (NaN equal to NaN: a one-token call has no TPOT)."""
    a, b = a.drop_columns(["point"]).to_pylist(), b.drop_columns(["point"]).to_pylist()
    return str(a) == str(b)  # (repr writes each float exactly and NaN as nan)


def test_fcfs_is_the_run_without_the_option(setup, sample_head, tmp_path):
    plain_rows, plain = replay(setup, "plain")
    fcfs_rows, fcfs = replay(setup, "fcfs-given", task_order="fcfs")
    assert same_rows(plain_rows, fcfs_rows) and plain["engine"] == fcfs["engine"]
    # and on a real agent trace with a queue (two sequences at a time), where any reordering would show
    head = sample_head("agent", 200)
    runs = []
    for name, opts in (("plain", {}), ("fcfs", {"task_order": "fcfs"})):
        opts = {"closed_loop": True, "max_num_seqs": 2} | opts
        run_dir, summary = run_replay(head, "engine-sim", opts, out=tmp_path / name, report=False)
        runs.append((pq.read_table(run_dir / "requests.parquet"), summary["points"][0]["engine"]))
    assert runs[0][1]["queue_s"]["mean"] > 0  # calls did wait: the order of the queue mattered
    assert same_rows(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


def test_with_retention_the_order_still_holds_and_kv_is_kept(setup):
    """--task-retention keeps a0's KV until a1 is admitted: the same admissions (the pool is large), and a0's
    blocks stay held from 0 until a1 starts (4 s later under fewest-remaining-calls)."""
    rows, point = replay(setup, "kept", task_order="fewest-remaining-calls", task_retention=True)
    assert starts_and_finishes(rows) == {
        c: (float(s), float(f)) for c, (s, f) in EXPECTED["fewest-remaining-calls"].items()
    }
    assert point["engine"]["scenarios"]["agent-tasks"]["task_retention"] is True


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"task_order": "shortest-first", "closed_loop": True}, "--task-order 'shortest-first': not one of fcfs"),
        ({"task_order": "oldest-task", "closed_loop": False}, "--task-order oldest-task .* needs --closed-loop"),
    ],
)
def test_bad_task_orders_are_refused(setup, opts, message):
    with pytest.raises(KvbenchError, match=message):
        replay(setup, "bad", **opts)


def test_the_report_puts_orders_side_by_side_with_their_ratio_to_fcfs(setup):
    """The report's Task scheduling table for two runs, as `kvbench compare` passes them: mean completion
    (5 + 3.9 + 9.3) / 3 = 6.067 s against (7 + 3.9 + 8.8) / 3 = 6.567 s, 0.92×; p99 of the three by linear
    interpolation: fcfs 8.8 - 0.02·(8.8 - 7) = 8.764 s, fewest-remaining-calls 9.3 - 0.02·(9.3 - 5) = 9.214 s."""
    from kvbench.report.page import render_markdown
    from kvbench.report.tasks import task_comparison_section

    runs = []
    for order in ("fcfs", "fewest-remaining-calls"):
        trace, calib, tmp = setup
        opts = {"calibration": str(calib), "max_num_seqs": 1, "closed_loop": True, "task_order": order}
        _, summary = run_replay(trace, "engine-sim", opts, out=tmp / f"report-{order}", report=False)
        runs.append(summary | {"_label": order})
    section = task_comparison_section(runs)
    text = render_markdown("t", [section])
    ratio = ((5 + 3.9 + 9.3) / 3) / ((7 + 3.9 + 8.8) / 3)
    p99 = (9.3 - 0.02 * (9.3 - 5)) / (8.8 - 0.02 * (8.8 - 7))
    assert f"mean task completion {ratio:.2f}×, p99 {p99:.2f}×" in text
    table = section.items[1]
    assert [row[1] for row in table.rows] == ["fcfs", "fewest-remaining-calls"]
    assert [row[3] for row in table.rows] == ["3", "3"]


def test_a_task_order_always_runs_the_python_loop(setup, monkeypatch):
    """The compiled loop covers runs without scenarios only; a task order needs the closed loop, which activates
    the agent-tasks scenario, so it never reaches the compiled loop (which knows nothing of task orders)."""
    from kvbench.backends.enginesim import compiled_run

    def refuse(*args, **kwargs):
        raise AssertionError("the compiled loop ran a replay with a task order")

    monkeypatch.setattr(compiled_run, "run", refuse)
    rows, _ = replay(setup, "python-loop", task_order="oldest-task")
    assert starts_and_finishes(rows) == {c: (float(s), float(f)) for c, (s, f) in EXPECTED["oldest-task"].items()}
