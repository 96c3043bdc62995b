"""oneDNN prepacked matmuls: the CPU fast path of every ``Linear`` and the LM head.

Chapter 7 (where a CPU step spends its time: almost all of it in these matmuls);
chapter 2 measures the roofline they are compared against.
vLLM 0.32 counterpart: ``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``, which ``UnquantizedLinearMethod.
process_weights_after_loading`` (``vllm/model_executor/layers/linear.py``) calls
once the checkpoint is loaded; it hands x86 CPUs to a oneDNN matmul the same way.

Why a second matmul path at all? ``F.linear`` on a CPU build of torch goes to a
BLAS ``sgemm`` that re-reads the weight in its plain [out, in] layout on every
call. oneDNN can instead *reorder* the weight once, at load time, into the blocked
layout its AVX-512 micro-kernel streams through, and then every call skips that
work. On the 2-core AMD EPYC these notes were measured on, the same fp32 product
ran at about 120-200 GFLOP/s through ``F.linear`` and 350-470 GFLOP/s through
the prepacked weight (``scripts/bench.py`` prints both rooflines side by side).

The reference stays: ``linear_backend="torch"`` keeps ``F.linear`` everywhere,
and the tests compare both paths on the same weights. The results agree to
fp32 rounding (the two libraries sum the products in different orders), which
is why greedy tokens still match HF transformers token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_BACKENDS = ("auto", "torch", "onednn")
# Dtypes oneDNN prepacks on a CPU without special hardware; others use F.linear.
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
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


def resolve_linear_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" becomes "onednn" on a CPU whose torch has it (fp32/bf16), else "torch"."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {requested!r}.")
    usable = device.type == "cpu" and dtype in _ONEDNN_DTYPES and onednn_available()
    if requested == "onednn" and not usable:
        raise ValueError(
            f"linear_backend='onednn' needs a CPU device, dtype float32 or bfloat16 and a torch "
            f"built with oneDNN; got device={device.type}, dtype={dtype}, "
            f"oneDNN available={onednn_available()}."
        )
    if requested == "auto":
        return "onednn" if usable else "torch"
    return requested


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


class PackableLinear(nn.Module):
    """A module with a [out, in] ``weight`` that can switch to the prepacked path.

    ``Linear`` and ``LMHead`` inherit it; ``forward`` code calls ``self.matmul``
    and never needs to know which path runs.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed: bool = False

    def use_onednn(self) -> None:
        """Replace ``weight`` by its prepacked copy; the plain one is dropped so
        the weights are not held twice. A tied LM head gets a packed copy of its
        own, while the embedding keeps the plain matrix for its row lookups."""
        self.weight = pack_weight(self.weight)
        self.packed = True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def process_weights_after_loading(model: nn.Module, backend: str) -> int:
    """Switch every ``PackableLinear`` of ``model`` to ``backend``; returns how many.

    Runs once, after ``load_weights``: packing must see the final weights, and
    nothing may load into a packed weight afterwards.
    """
    if backend == "torch":
        return 0
    layers = [m for m in model.modules() if isinstance(m, PackableLinear)]
    for layer in layers:
        layer.use_onednn()
    return len(layers)
