"""The gateway's request metrics keep their labelled children (one `labels()` per
route and status, not per request) and count exactly as before."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics


def test_requests_and_latency_by_route_and_status() -> None:
    metrics = GatewayMetrics()
    for status in (200, 200, 429):
        metrics.count_request("chat", status)
    metrics.count_request("responses", 200)
    metrics.observe_latency("chat", 0.02)
    metrics.observe_latency("chat", 3.0)
    assert metrics.totals("areal_requests")["areal_requests"] == {
        ("chat", "200"): 2.0,
        ("chat", "429"): 1.0,
        ("responses", "200"): 1.0,
    }
    counts = {
        s.labels.get("le"): s.value
        for family in metrics.registry.collect()
        if family.name == "areal_request_latency_seconds"
        for s in family.samples
        if s.name.endswith("_bucket")
    }
    assert counts["0.025"] == 1.0 and counts["5.0"] == 2.0


def test_policy_metrics_keep_one_child_per_policy_and_phase() -> None:
    metrics = GatewayMetrics()
    timings = {
        "http://a": {"pause_s": 0.01, "update_s": 0.2, "continue_s": 0.001, "total_s": 0.211},
        "http://b": {"pause_s": 0.02, "update_s": 0.3, "continue_s": 0.002, "total_s": 0.322},
    }
    for _ in range(3):  # three swaps, three versions: still one child per label set
        metrics.observe_swap("solver", timings, 0.5)
        metrics.set_policy_version("solver", 3)
        metrics.observe_reward("solver", 1.5)
    metrics.set_policy_version("default", 0)
    # 5 swap phases + 2 versions + 1 reward, made once each.
    assert len(metrics._policy_children) == 5 + 2 + 1
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.registry.collect()
        if family.name.startswith("areal_policy")
        for s in family.samples
    }
    assert samples[("areal_policy_version", (("policy", "solver"),))] == 3
    assert samples[("areal_policy_version", (("policy", "default"),))] == 0
    total = (("phase", "total"), ("policy", "solver"))
    assert samples[("areal_policy_swap_seconds_count", total)] == 6  # 2 backends × 3 swaps
    assert abs(samples[("areal_policy_swap_seconds_sum", total)] - 3 * 0.533) < 1e-9
    whole = (("phase", "swap"), ("policy", "solver"))
    assert samples[("areal_policy_swap_seconds_count", whole)] == 3
    assert samples[("areal_policy_reward_count", (("policy", "solver"),))] == 3
    assert samples[("areal_policy_reward_sum", (("policy", "solver"),))] == 4.5
