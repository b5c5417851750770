"""The overhead benchmark's baseline comparison: ratios of this tree to the baseline
from the same rounds, and the warning line exactly when a CPU cost rose beyond the
threshold (CI prints it; a regression must not pass unseen again)."""

from __future__ import annotations

from benchmarks.gateway_overhead import CPU_WARN, MAX_TOKENS, Result, baseline_report


def _results(cpu: dict[str, tuple[float, float]]) -> dict[str, list[Result]]:
    """name -> (non-stream CPU ms/req, stream CPU ms/req); 100 requests in 1 s each."""
    out = {}
    for name, (plain, stream) in cpu.items():
        for mode, ms in (("non-stream", plain), ("stream", stream)):
            out[f"{name} {mode}"] = [Result(f"{name} {mode}", 1.0, [0.01] * 100, cpu_ms=ms)]
    return out


def test_within_threshold_prints_no_warning():
    lines = baseline_report(_results({"gateway": (0.55, 1.0), "baseline": (0.5, 0.95)}), "abc123")
    assert not any(line.startswith("WARNING") for line in lines)
    assert "1.10x" in "\n".join(lines)  # 0.55 / 0.5


def test_cpu_rise_beyond_threshold_warns_and_names_the_cost():
    rise = 1 + CPU_WARN + 0.05
    lines = baseline_report(
        _results({"gateway": (0.5 * rise, 1.0), "baseline": (0.5, 1.0)}), "abc123"
    )
    warning = [line for line in lines if line.startswith("WARNING")]
    assert len(warning) == 1 and "non-stream request" in warning[0] and "abc123" in warning[0]


def test_per_token_rise_warns():
    # Same non-stream cost; the stream costs 10 us/token more over 32 tokens.
    lines = baseline_report(
        _results(
            {
                "gateway": (0.5, 0.5 + 0.64 * MAX_TOKENS / 32),
                "baseline": (0.5, 0.5 + 0.32 * MAX_TOKENS / 32),
            }
        ),
        "x",
    )
    assert any("streamed token" in line for line in lines if line.startswith("WARNING"))
