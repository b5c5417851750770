"""Prometheus metrics of the gateway, one registry per app (no import-time globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    """Request, token, latency and capture metrics, labelled by route."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("areal_requests", "Requests served", ["route", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("areal_prompt_tokens", "Prompt tokens sent to backends",
                                     registry=self.registry)
        self.completion_tokens = Counter("areal_completion_tokens", "Tokens generated",
                                         registry=self.registry)
        self.in_flight = Gauge("areal_in_flight_requests", "Requests being served",
                               registry=self.registry)
        self.latency = Histogram(
            "areal_request_latency_seconds", "End-to-end latency", ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry)
        self.ttft = Histogram(
            "areal_time_to_first_token_seconds", "Streaming time to first token",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry)
        self.capture_wait = Histogram(
            "areal_capture_wait_seconds", "Time waiting for the completion to be durable",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=self.registry)
        self.resubmissions = Counter("areal_resubmissions", "Aborted generations resubmitted",
                                     registry=self.registry)
        self.continuity = Counter(
            "areal_token_continuity",
            "Prompts by how they were built: continued (an earlier completion's ids + the "
            "new messages' tokens), no_match (full render), or a full-render fallback "
            "(prefix_changed, not_prefix_stable, no_end_of_turn)", ["outcome"],
            registry=self.registry)
