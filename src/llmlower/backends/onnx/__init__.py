"""The ONNX Runtime backend: lower a Program to ONNX (com.microsoft GroupQueryAttention, MatMulNBits,
(Skip)SimplifiedLayerNormalization; export.to_onnx) run by runtime.executors.onnx (per-sequence buffers) or
runtime.executors.onnx_paged (PagedAttention); artifact.build writes it as a deployable artifact directory."""

from ...step_io import KVLayout
from ..backend import Backend, Tolerance

BACKEND = Backend(
    name="onnx",
    package=__name__,
    layouts={"cpu": KVLayout.SLOTS, "cuda": KVLayout.PAGED},
    executors={KVLayout.SLOTS: "onnx:OnnxSlotExecutor", KVLayout.PAGED: "onnx_paged:OnnxPagedExecutor"},
    compiler="artifact:build",
    program_executor="program_executor:program_executor",
    summary="ONNX Runtime: GroupQueryAttention over per-sequence buffers on CPU, PagedAttention on CUDA",
    options=("accuracy_level",),
    # MatMulNBits at accuracy_level 4 (the default) quantizes activations to int8 per block: measured up to
    # 0.034 of the logits' scale on the tiny checkpoints (q8, q4g32, q4g32-zp4, q4g128-sym, q4mix), on SmolLM2
    # q4g32 up to ~1.3 of ~25 (0.05), and on SmolLM2 q4mix 0.05-0.075 a step and 0.107 on verify_artifact's
    # second chunk (5 prompt tokens after 4); the tiny random hybrids, whose decays amplify it, 0.107 (Qwen3.5) and
    # 0.14 (Jamba). At level 0 it computes in float32 (1.1e-6).
    tolerance=Tolerance(rounded_activations=0.15),
    # GroupQueryAttention's PER_CHANNEL quantization (its float caches are q's dtype); CUDA's PagedAttention has none
    kv_cache_dtypes={"cpu": ("int8",)},
    toolkit=("onnx", "onnxruntime"),
)
