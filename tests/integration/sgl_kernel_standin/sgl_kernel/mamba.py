"""Mamba / gated-delta ops, imported by SGLang's linear-attention backends; never called here."""

from sgl_kernel._stubs import unavailable

causal_conv1d_fn_cpu = unavailable("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = unavailable("mamba.causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = unavailable("mamba.chunk_gated_delta_rule_cpu")
