"""Prepacked matmuls: the CPU fast paths of every linear layer and the LM head.

Chapter 7 (where a CPU step spends its time: almost all of it in these matmuls);
chapter 2 measures the roofline they are compared against.
vLLM 0.32 counterpart: ``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``, which ``UnquantizedLinearMethod.
process_weights_after_loading`` (``vllm/model_executor/layers/linear.py``) calls
once the checkpoint is loaded; it hands x86 CPUs to a oneDNN matmul the same way.

Why other matmul paths at all? ``F.linear`` on a CPU build of torch goes to a
BLAS ``sgemm`` that re-reads the weight in its plain [out, in] layout on every
call. A weight can instead be *reordered* once, at load time, into a blocked
layout a micro-kernel streams through, and then every call skips that work.
Two such paths exist (``linear_backend``):

* ``"onednn"``: oneDNN's reorder and matmul, vLLM's choice. On the 2-core AMD
  EPYC these notes were measured on, ~470 GFLOP/s on a large fp32 product
  (``F.linear``: ~200), but only ~270 at the 32 rows of a decode batch.
* ``"cpu"``: nanoengine's own kernels, written for exactly that decode case:
  they prefetch the weight stream ahead of the arithmetic. In fp32
  (``csrc/cpu/gemm.cpp``) ~400 GFLOP/s at 32 rows, ~460 on large products;
  ``"auto"`` picks it in the AVX-512 and AVX2 kernel variants, each with a
  register tile sized for its own register file.
  In bf16 (``csrc/cpu/gemm_bf16.cpp``) on AMX tiles or AVX-512 BF16
  dot products, whichever the CPU has (AMX first: measured faster, chapter 7);
  ``"auto"`` picks it wherever one of the two exists, and oneDNN elsewhere.

The reference stays: ``linear_backend="torch"`` keeps ``F.linear`` everywhere,
and the tests compare every path on the same weights. The results agree to
fp32 rounding (each path sums the products in its own order), which is why
greedy tokens still match HF transformers token for token.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine._custom_ops import cpu_ops_available, load_cpu_ops
from nanoengine.model_executor.layers.quantization.base_config import QuantizeMethodBase
from nanoengine.platforms.cpu import cpu_bf16_features, kernel_isa, warn_slow_bf16_once

LINEAR_BACKENDS = ("auto", "torch", "onednn", "cpu")
# Dtypes oneDNN prepacks on a CPU without special hardware; others use F.linear.
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# The kernel variants whose GEMM tile was sized and measured for their registers
# (csrc/cpu/ops.h, kTileRows): "auto" picks nanoengine's GEMM on these. Chapter 7's
# kernel table (scripts/bench_kernels.py) is the evidence: at the 1-64 rows of a
# decode step it beat oneDNN on both, by up to ~1.5x on AVX2 and ~2x on AVX-512.
GEMM_TUNED_ISAS = ("avx512", "avx2")
# oneDNN picks its blocking for this many rows; any row count still works.
# A decode batch is tens of rows, so a hint in that range suits the hot loop.
PACK_BATCH_HINT = 32


def onednn_available() -> bool:
    """This torch build ships oneDNN and the prepacked-linear operators."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def onednn_supports(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear runs ``dtype`` on this CPU.

    fp32 runs everywhere oneDNN does. For bf16, oneDNN needs AVX-512 (BW, VL and
    DQ) or AVX-NE-CONVERT to convert the numbers: on a CPU with only AVX2 torch
    refuses to pack a bf16 weight, and bf16 matmuls go through ``F.linear``.
    """
    if dtype not in _ONEDNN_DTYPES or not onednn_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_gemm_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """nanoengine's C++ GEMM can run here: a CPU, the kernels built, and fp32 or
    (bf16 and a CPU with bf16 dot products)."""
    if device.type != "cpu" or not cpu_ops_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(bf16_gemm_kernels())


@functools.cache
def bf16_gemm_kernels() -> tuple[str, ...]:
    """The bf16 kernels of gemm_bf16.cpp this CPU runs, fastest first (() if none)."""
    return tuple(load_cpu_ops().bf16_gemm_kernels()) if cpu_ops_available() else ()


def resolve_linear_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """ "auto" -> "cpu" (an AVX-512 or AVX2 kernel variant), else "onednn" (CPU, fp32/bf16), else "torch"."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {requested!r}.")
    onednn_usable = device.type == "cpu" and onednn_supports(dtype)
    if requested == "onednn" and not onednn_usable:
        raise ValueError(
            f"linear_backend='onednn' needs a CPU device, dtype float32 or bfloat16 and a torch "
            f"built with oneDNN (and, for bfloat16, a CPU with AVX-512 or AVX-NE-CONVERT); got "
            f"device={device.type}, dtype={dtype}, oneDNN available={onednn_available()}, "
            f"oneDNN runs {dtype} here={onednn_supports(dtype)}."
        )
    if requested == "cpu" and not cpu_gemm_usable(device, dtype):
        raise ValueError(
            f"linear_backend='cpu' needs a CPU device, nanoengine's C++ kernels and dtype float32, or "
            f"bfloat16 on a CPU with AMX or avx512_bf16 ({cpu_bf16_features().describe()} here); "
            f"got device={device.type}, dtype={dtype}."
        )
    if requested != "auto":
        return requested
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_gemm_usable(device, dtype):
        warn_slow_bf16_once()
    if cpu_gemm_usable(device, dtype) and kernel_isa() in GEMM_TUNED_ISAS:
        return "cpu"
    return "onednn" if onednn_usable else "torch"


def pack_weight(weight: torch.Tensor) -> nn.Parameter:
    """Reorder a [out, in] weight into oneDNN's blocked layout, once.

    The result is an opaque tensor: it reports the logical shape [out, in] and
    dtype (so parameter counts and byte totals stay right), but only
    ``onednn_linear`` can read it.
    """
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
    return nn.Parameter(packed, requires_grad=False)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` with a weight from ``pack_weight``. x [..., in] -> [..., out]."""
    if x.dim() == 2:  # what the models pass: [num_tokens, in]
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])  # [num_rows, in]; the operator takes 2-D input
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the panels of gemm.cpp (fp32) or gemm_bf16.cpp (bf16)."""
    if weight.dtype == torch.bfloat16:
        return load_cpu_ops().pack_linear_weight_bf16(weight.contiguous())
    return load_cpu_ops().pack_linear_weight(weight.contiguous())


def cpu_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    bf16_kernel: str | None = None,
) -> torch.Tensor:
    """``x @ W^T + b`` with a weight from ``pack_cpu_weight``.

    x [..., in] -> [..., out_features]. fp32: packed [ceil(out / P), in, P]
    (P = 32 with AVX-512, 16 with AVX2, 8 with 4-lane vectors); bf16: packed [ceil(out / 32), K2 / 2,
    32, 2], run on ``bf16_kernel`` (default: the first of ``bf16_gemm_kernels()``).
    """
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [num_rows, in], dense rows
    if packed.dtype == torch.bfloat16:
        kernel = bf16_kernel or bf16_gemm_kernels()[0]
        out = load_cpu_ops().packed_linear_bf16(rows, packed, bias, out_features, kernel)
    else:
        out = load_cpu_ops().packed_linear(rows, packed, bias, out_features)
    return out.view(*x.shape[:-1], out_features)


class PackableLinear(nn.Module):
    """A module with a [out, in] ``weight`` that can switch to a prepacked path.

    The linear layers (``linear.py``) and ``ParallelLMHead`` inherit it;
    ``forward`` code calls ``self.matmul`` and never needs to know which path
    runs. Under tensor parallelism the weight is this rank's shard, packed like
    any other matrix.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    backend: str = "torch"  # "torch" (plain weight), "onednn" or "cpu" (packed)
    out_features: int = 0  # set by pack(): a packed weight's shape no longer says it
    in_features: int = 0  # likewise: the plain weight was [out_features, in_features]
    bf16_kernel: str | None = None  # set by pack() for a bf16 weight on "cpu": "amx" or "avx512_bf16"
    # Set for a quantized weight (layers/quantization/): the method that multiplies by it.
    quant_method: QuantizeMethodBase | None = None

    @property
    def packed(self) -> bool:
        return self.backend != "torch"

    def pack(self, backend: str) -> None:
        """Replace ``weight`` by its copy prepacked for ``backend``; the plain one
        is dropped so the weights are not held twice. A tied LM head gets a
        packed copy of its own, while the embedding keeps the plain matrix for
        its row lookups.
        """
        self.out_features, self.in_features = (int(size) for size in self.weight.shape)
        weight = self.weight.detach()
        if backend == "onednn":
            self.weight = pack_weight(weight)
        elif backend == "cpu":
            self.weight = nn.Parameter(pack_cpu_weight(weight), requires_grad=False)
            self.bf16_kernel = bf16_gemm_kernels()[0] if weight.dtype == torch.bfloat16 else None
        else:
            raise ValueError(f"cannot pack a weight for linear_backend={backend!r}")
        self.backend = backend

    def matmul(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x [..., in] -> [..., out]; ``add_bias=False`` leaves the bias out (a
        row-parallel layer adds it once, after summing the ranks' partial results)."""
        bias = self.bias if add_bias else None
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        if self.backend == "cpu":
            return cpu_linear(x, self.weight, bias, self.out_features, self.bf16_kernel)
        if self.backend == "onednn":
            return onednn_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


def process_weights_after_loading(model: nn.Module, backend: str) -> int:
    """Switch every ``PackableLinear`` of ``model`` to ``backend``; returns how many.

    Runs once, after ``load_weights``: packing must see the final weights, and
    nothing may load into a packed weight afterwards.
    """
    # A quantized layer keeps its blocks: its method has a fast path of its own, picked now.
    for module in model.modules():
        if isinstance(module, PackableLinear) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)
    if backend == "torch":
        return 0
    layers = [m for m in model.modules() if isinstance(m, PackableLinear) and m.quant_method is None]
    for layer in layers:
        layer.pack(backend)
    return len(layers)
