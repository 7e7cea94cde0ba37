"""A peer kept off AMX tiles, as on a CPU with AVX-512 BF16 but no AMX (Zen 4): put this folder on PYTHONPATH with
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (benchmarks/peers/runner.without_amx_environment). Python runs this file at
start-up in every process of the peer, its workers too; it makes torch's AMX check answer no, which is what vLLM's
CPU build asks before taking its AMX attention and linear kernels, and oneDNN stops at AVX-512 by the variable."""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
