"""benchmarks/vllm_gateway.py: its statistics, table, run order and SSE parsing (no
servers)."""

from __future__ import annotations

import json
import math

from benchmarks.vllm_gateway import (
    Run,
    _usage_tokens,
    first_content,
    pct,
    pool,
    run_order,
    summarize,
    table,
    window_share,
)


def _run(
    path: str,
    mode: str,
    c: int,
    latencies: list[float],
    *,
    window: float = 10.0,
    ttfts: list[float] | None = None,
    cpu: dict[str, float] | None = None,
    round_: int = 1,
    done: float | None = None,
) -> Run:
    return Run(
        path,
        mode,
        c,
        round_,
        window,
        len(latencies) if done is None else done,
        sorted(latencies),
        sorted(ttfts or []),
        [32] * len(latencies),
        cpu or {},
    )


def test_pct_nearest_rank_and_empty():
    assert pct([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0
    assert pct([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
    assert pct([5.0], 0.5) == 5.0
    assert math.isnan(pct([], 0.5))


def test_window_share_credits_the_part_inside():
    assert window_share(2.0, 4.0, 0.0, 10.0) == 1.0
    assert window_share(-1.0, 1.0, 0.0, 10.0) == 0.5  # started in the warm-up
    assert window_share(9.0, 13.0, 0.0, 10.0) == 0.25  # ends in the drain
    assert window_share(-1.0, 11.0, 0.0, 6.0) == 0.5  # longer than the window
    assert window_share(11.0, 12.0, 0.0, 10.0) == 0.0
    assert window_share(5.0, 5.0, 0.0, 10.0) == 1.0
    # waves: 32 clients, 4 s requests, window 4 s at any phase = 32 requests' work
    for phase in (0.0, 1.3, 2.9):
        waves = [(t, t + 4.0) for t in range(-8, 16, 4)]
        done = sum(32 * window_share(t0, t1, phase, phase + 4.0) for t0, t1 in waves)
        assert abs(done - 32) < 1e-9


def test_pool_sums_windows_and_weights_cpu_by_requests():
    a = _run(
        "gateway",
        "stream",
        8,
        [0.1] * 10,
        window=5.0,
        ttfts=[0.01] * 10,
        cpu={"vllm": 10.0, "gateway": 2.0},
    )
    b = _run(
        "gateway",
        "stream",
        8,
        [0.3] * 30,
        window=5.0,
        ttfts=[0.03] * 30,
        cpu={"vllm": 20.0, "gateway": 4.0},
        done=30.5,
    )
    s = pool([a, b])
    assert s.n == 40
    assert s.rps == 4.05  # 40.5 requests' work over 10 s of windows
    assert s.p50_ms == 300.0
    assert s.ttft_p50_ms == 30.0
    assert s.tokens_per_req == 32.0
    assert s.cpu_ms == {"gateway": (2 * 10 + 4 * 30.5) / 40.5, "vllm": (10 * 10 + 20 * 30.5) / 40.5}


def test_summarize_rows_ratio_added_and_targets():
    runs = [
        _run("direct", "non-stream", 1, [1.000] * 10),
        _run("gateway", "non-stream", 1, [1.004] * 10),
        _run("direct", "stream", 1, [1.0] * 10, ttfts=[0.05] * 10),
        _run("gateway", "stream", 1, [1.1] * 9, ttfts=[0.06] * 9),
        _run("direct", "stream", 8, [1.0] * 80),
    ]  # no gateway run: no row
    rows = summarize(runs)
    assert [(r.mode, r.concurrency) for r in rows] == [("non-stream", 1), ("stream", 1)]
    ns, st = rows
    assert ns.ratio == 1.0 and ns.ratio_met
    assert abs(ns.added_p50_ms - 4.0) < 1e-9 and ns.p50_met
    assert ns.added_ttft_ms is None
    assert abs(st.ratio - 0.9) < 1e-9 and not st.ratio_met
    assert abs(st.added_p50_ms - 100.0) < 1e-9 and not st.p50_met
    assert abs(st.added_ttft_ms - 10.0) < 1e-9
    json.dumps([r.to_json() for r in rows])  # --json can save it

    lines = table(rows)
    assert "direct r/s" in lines[0] and "gw r/s" in lines[0] and "ratio" in lines[0]
    body = "\n".join(lines)
    assert "non-stream C=1   ratio 1.00x [met]  added p50 +4.0 ms [met]" in body
    assert "stream     C=1   ratio 0.90x [NOT met]  added p50 +100.0 ms [NOT met]" in body
    assert "all cells: ratio NOT met, added p50 NOT met" in body


def test_run_order_abab_first_path_alternates():
    order = list(run_order(2, ["non-stream", "stream"], [1, 8]))
    assert len(order) == 8
    assert [o[3] for o in order[:4]] == [("direct", "gateway")] * 4
    assert [o[3] for o in order[4:]] == [("gateway", "direct")] * 4
    assert [(o[1], o[2]) for o in order[:4]] == [
        ("non-stream", 1),
        ("non-stream", 8),
        ("stream", 1),
        ("stream", 8),
    ]


def test_first_content_waits_for_complete_lines_and_content():
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    word = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    assert first_content(role) == (False, b"")
    found, rest = first_content(role + word[:20])  # the content chunk not complete yet
    assert not found and rest == word[:20]
    assert first_content(rest + word[20:])[0]


def test_usage_tokens_from_the_stream_tail():
    tail = (
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":36,"completion_tokens":32}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert _usage_tokens(tail) == 32
    assert _usage_tokens(tail[40:]) == 32  # a cut first line is skipped
    assert _usage_tokens(b"data: [DONE]\n\n") is None
