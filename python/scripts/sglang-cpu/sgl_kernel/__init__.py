"""Pure-torch stand-in for the sgl_kernel CPU ops SGLang imports under SGLANG_USE_CPU_ENGINE=1."""
import ctypes


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    off = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[off:off + e - s].to(req_to_token.dtype)
        off += e - s


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for t, s in zip(tgt_loc.tolist(), src_loc.tolist()):
            ctypes.memmove(ptr + t * stride, ptr + s * stride, stride)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not implemented")

    return missing
