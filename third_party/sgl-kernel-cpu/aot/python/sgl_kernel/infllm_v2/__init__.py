from sgl_kernel.infllm_v2.attention import infllmv2_attn_stage1
from sgl_kernel.infllm_v2.max_pooling import max_pooling_1d_varlen

__all__ = [
    "infllmv2_attn_stage1",
    "max_pooling_1d_varlen",
]
