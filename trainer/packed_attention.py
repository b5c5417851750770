"""Attention over packed rows at the cost of the sequences, not of the row.

A packed row (`trainer/batch.py`) holds several sequences back to back. transformers'
`sdpa` keeps them apart with a block-diagonal L x L mask, so its attention costs the
whole row squared: on the demo's batch (16 sequences of 59 tokens in one 944-token row)
that is 16x the work of attending within each sequence, and on a CPU it was a fifth of
the whole training step (`benchmarks/trainer_step.py`). `flash_attention_2` avoids it
with variable-length kernels, but runs only on CUDA.

`PACKED_SDPA` is sdpa with one difference: given the row's sequence boundaries
(`cu_seq_lens_q`, the keyword flash attention's varlen path reads, which
`trainer.step.forward_logprobs` passes), it gathers the sequences into a right-padded
(n, heads, longest, dim) batch and runs one causal SDPA over it. Right padding needs no
mask under causality: a real query never sees a later (padded) key, and the padded
queries' outputs are dropped. Without boundaries, or for a layer whose attention is not
plain causal (a sliding window, a soft cap, a position bias), it is transformers' sdpa
unchanged. The mask transformers builds for the row is still built (once per forward,
not per layer) and ignored on the packed path.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "areal_packed_sdpa"
"""The attention implementation name the trainer loads its models with."""


def register_packed_sdpa() -> str:
    """Make `PACKED_SDPA` known to transformers (idempotent); returns the name to pass as
    `attn_implementation`."""
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    return PACKED_SDPA


def _plain_causal(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    return (
        getattr(module, "is_causal", True)
        and getattr(module, "sliding_window", None) is None
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
    )


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (1, H, L, D), key and value
    (1, H_kv, L, D) -> output (1, L, H, D). Per-sequence causal attention when
    `cu_seq_lens_q` is given for a single row; transformers' sdpa otherwise."""
    cu = kwargs.get("cu_seq_lens_q")
    packed = (
        cu is not None
        and query.shape[0] == 1
        and int(cu[-1]) == query.shape[2] == key.shape[2]
        and _plain_causal(module, kwargs)
    )
    if not packed:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    longest = int(lens.max())
    offsets = torch.arange(longest, device=query.device)
    valid = offsets[None, :] < lens[:, None]  # (n, longest)
    # Padded slots read their sequence's first token: any real index will do, the
    # outputs there are dropped (and causality keeps real queries off them).
    index = starts[:, None] + torch.where(valid, offsets[None, :], 0)
    q, k, v = (t[0][:, index].transpose(0, 1) for t in (query, key, value))  # (n, H, Lmax, D)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling
    )
    # (n, H, Lmax, D) -> the real positions in row order -> (1, L, H, D)
    return out.transpose(1, 2)[valid][None], None
