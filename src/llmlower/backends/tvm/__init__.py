"""The TVM backend: lower a PAGED Program to Relax (relax_import.to_relax: llmlower's paged-attention TIR kernels
over block pools the runtime owns, dequantize-in-matmul for int8/int4 weights; on x86 CPUs grouped quantized
matmuls in int8, accuracy_level 4), compile it for llvm or CUDA (compile.compile_module) and run it with
runtime.executors.tvm.TvmExecutor; artifact.build writes the library, its weights (safetensors) and the manifest
as a deployable artifact."""

from ...step_io import KVLayout
from ..backend import Backend, Tolerance

BACKEND = Backend(
    name="tvm",
    package=__name__,
    layouts={"cpu": KVLayout.PAGED, "cuda": KVLayout.PAGED},
    executors={KVLayout.PAGED: "tvm:TvmExecutor"},
    compiler="artifact:build",
    program_executor="program_executor:program_executor",
    summary="Apache TVM: Relax + llmlower's paged-attention kernels, llvm (CPU) or CUDA",
    options=("accuracy_level", "cuda_arch", "cpu", "vm_exec"),
    check="compile:check_options",
    # accuracy_level 4 (the CPU default) rounds activations to int8: per group for the grouped quantized matmuls, as
    # ONNX Runtime's MatMulNBits does at its level 4, and per row for int8 weights per channel (the -a8 mixes), which
    # the reference does not model: SmolLM2's prompts off by up to 0.17 of the logits' scale (q4mix-a8 with GPTQ)
    # and 0.28 (q4mlp-a8, the fast recipe), whose perplexity one token a step is within 4% of fp32's; a broken
    # kernel's logits are off by their whole scale
    tolerance=Tolerance(rounded_activations=0.35),
    kv_cache_dtypes={"cpu": ("float16", "int8")},  # the CUDA kernels read pools of the model's dtype
    toolkit=("tvm",),
)
