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
