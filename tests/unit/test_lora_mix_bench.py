"""benchmarks/lora_mix.py: the adapter-size arithmetic it prints beside the measured RSS
(no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lora_mix import analytic_adapter_bytes, safetensors_tensor_bytes, slope


@pytest.mark.parametrize("rank", [4, 8])
def test_analytic_adapter_bytes_equal_what_peft_writes(
    tiny_model_dir: Path, tmp_path: Path, rank: int
) -> None:
    """The bytes computed from config.json (rank x (in + out) per projection) are the
    bytes of the tensors PEFT saves for the same rank and targets, on a model with
    grouped KV heads (k/v narrower than q)."""
    from benchmarks.lora_swap import write_adapter

    adapter = write_adapter(str(tiny_model_dir), tmp_path / "adapter", rank, seed=0)
    tensors, file = safetensors_tensor_bytes(adapter)
    assert analytic_adapter_bytes(str(tiny_model_dir), rank) == tensors
    assert file > tensors  # the file adds its JSON header


def test_slope_is_the_least_squares_fit() -> None:
    assert slope([(1, 110), (2, 120), (4, 140), (8, 180)]) == pytest.approx(10.0)
    assert slope([(1, 0), (2, 2), (4, 2), (8, 8)]) == pytest.approx(
        (sum((x - 3.75) * y for x, y in [(1, 0), (2, 2), (4, 2), (8, 8)])) / 28.75
    )
