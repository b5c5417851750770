"""The project's stand-in for SGLang's CPU kernel package (`sgl_kernel`), a test fixture.

SGLang's CPU engine imports `sgl_kernel` when its modules load; the CPU build of that
package is on no registry (PyPI's `sglang-kernel` holds only CUDA code). With
`--attention-backend torch_native` on a CPU without AMX, the one function the server
calls is `assign_req_to_token_pool_cpu`, written here in plain torch with the meaning of
SGLang's Triton kernel `assign_req_to_token_pool`. The other names are asked for at
import only (speculative decoding, hierarchical KV cache, mamba); their stubs raise when
called, so a path that needs a real kernel fails loudly instead of computing nonsense.
No `torch.ops.sgl_kernel` op is registered: SGLang's AMX paths check for those and stay off.

Written for one SGLang release; importing it beside another fails at once, since the
names and the meaning of what SGLang calls may change between releases.
"""

from __future__ import annotations

from importlib import metadata

import torch

from sgl_kernel._stubs import unavailable

WRITTEN_FOR_SGLANG = "0.5.23"

try:
    _installed = f"sglang=={metadata.version('sglang')}"
except metadata.PackageNotFoundError:
    _installed = "no sglang"
if _installed != f"sglang=={WRITTEN_FOR_SGLANG}":
    raise ImportError(
        f"the project's sgl_kernel stand-in was written for sglang=={WRITTEN_FOR_SGLANG}; "
        f"{_installed} is installed: check which sgl_kernel functions it calls on a CPU "
        "and update the stand-in (tests/integration/sgl_kernel_standin/)"
    )


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request r with offsets [s, e), write the next e - s entries of
    `out_cache_loc` into `req_to_token[req_pool_indices[r], s:e]` (in place)."""
    del pool_len  # the row length; torch indexing knows it
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


copy_all_layer_kv_cache_cpu = unavailable("copy_all_layer_kv_cache_cpu")
assign_draft_cache_locs_contiguous_cpu = unavailable("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = unavailable("assign_extend_cache_locs_cpu")
build_draft_decode_metadata_cpu = unavailable("build_draft_decode_metadata_cpu")
build_tree_kernel_efficient_cpu = unavailable("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = unavailable("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = unavailable("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = unavailable("rotate_input_ids_cpu")
verify_tree_greedy_cpu = unavailable("verify_tree_greedy_cpu")
