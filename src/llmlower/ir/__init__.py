"""The llm op set shared by passes, backends and the cost model, and the Program they operate on."""

from .attention import ATTENTION
from .causal_attention import CAUSAL_ATTENTION
from .causal_conv import CAUSAL_CONV1D
from .gated_delta_rule import GATED_DELTA_RULE, GATED_DELTA_STEP
from .latent_attention import LATENT_ATTENTION, PAGED_LATENT_ATTENTION
from .moe import MOE_EXPERTS
from .norms import ADD_RMS_NORM, RMS_NORM
from .paged_attention import PAGED_ATTENTION
from .paged_qkv_attention import PAGED_QKV_ATTENTION
from .paged_recurrent import PAGED_RECURRENT
from .program import Program, TensorSpec
from .qkv_attention import QKV_ATTENTION
from .qlinear import QEMBEDDING, QLINEAR
from .qmoe import QMOE_EXPERTS
from .registry import OPS, Cost, OpDef, op_of, register_op
from .rope import ROPE
from .selective_scan import SELECTIVE_SCAN, SELECTIVE_STEP
from .silu_mul import SILU_MUL
from .ssd_scan import SSD_SCAN, SSD_STEP

__all__ = [
    "ADD_RMS_NORM",
    "ATTENTION",
    "CAUSAL_ATTENTION",
    "CAUSAL_CONV1D",
    "GATED_DELTA_RULE",
    "GATED_DELTA_STEP",
    "LATENT_ATTENTION",
    "MOE_EXPERTS",
    "OPS",
    "PAGED_ATTENTION",
    "PAGED_LATENT_ATTENTION",
    "PAGED_QKV_ATTENTION",
    "PAGED_RECURRENT",
    "QEMBEDDING",
    "QKV_ATTENTION",
    "QLINEAR",
    "QMOE_EXPERTS",
    "RMS_NORM",
    "ROPE",
    "SELECTIVE_SCAN",
    "SELECTIVE_STEP",
    "SILU_MUL",
    "SSD_SCAN",
    "SSD_STEP",
    "Cost",
    "OpDef",
    "Program",
    "TensorSpec",
    "op_of",
    "register_op",
]
