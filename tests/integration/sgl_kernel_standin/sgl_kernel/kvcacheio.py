"""Hierarchical KV-cache transfer ops (host <-> device); SGLang imports them, never calls them here."""

from sgl_kernel._stubs import unavailable

get_device_accessible_ptr = unavailable("kvcacheio.get_device_accessible_ptr")
transfer_embedding_ranges_direct = unavailable("kvcacheio.transfer_embedding_ranges_direct")
transfer_kv_all_layer = unavailable("kvcacheio.transfer_kv_all_layer")
transfer_kv_all_layer_direct_lf_pf = unavailable("kvcacheio.transfer_kv_all_layer_direct_lf_pf")
transfer_kv_all_layer_lf_pf = unavailable("kvcacheio.transfer_kv_all_layer_lf_pf")
transfer_kv_all_layer_lf_ph = unavailable("kvcacheio.transfer_kv_all_layer_lf_ph")
transfer_kv_all_layer_mla = unavailable("kvcacheio.transfer_kv_all_layer_mla")
transfer_kv_all_layer_mla_lf_pf = unavailable("kvcacheio.transfer_kv_all_layer_mla_lf_pf")
transfer_kv_direct = unavailable("kvcacheio.transfer_kv_direct")
transfer_kv_per_layer = unavailable("kvcacheio.transfer_kv_per_layer")
transfer_kv_per_layer_direct_pf_lf = unavailable("kvcacheio.transfer_kv_per_layer_direct_pf_lf")
transfer_kv_per_layer_mla = unavailable("kvcacheio.transfer_kv_per_layer_mla")
transfer_kv_per_layer_mla_pf_lf = unavailable("kvcacheio.transfer_kv_per_layer_mla_pf_lf")
transfer_kv_per_layer_pf_lf = unavailable("kvcacheio.transfer_kv_per_layer_pf_lf")
transfer_kv_per_layer_ph_lf = unavailable("kvcacheio.transfer_kv_per_layer_ph_lf")
