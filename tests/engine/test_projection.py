"""The projections' float16 GEMM (a bfloat16 model on an x86 CPU): the same products as a
bfloat16 GEMM that sums in float32, and the choice of kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbaton.engine import EngineConfig
from kvbaton.engine.model import Projection, fp16_gemm_available
from kvbaton.engine.model_runner import use_fp16_gemm

needs_fbgemm = pytest.mark.skipif(not fp16_gemm_available(), reason="FBGEMM is x86 only")
CPU = torch.device("cpu")


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp16_gemm_equals_a_float32_sum_of_the_bfloat16_products(
    rows: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(300, 200, generator=gen) * 0.05).to(torch.bfloat16)
    weight[0, :4] = torch.tensor([1e-6, -3e-7, 200.0, 6e-5])  # subnormal in float16, and large
    bias = torch.randn(300, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 200, generator=gen).to(torch.bfloat16)

    projection = Projection(weight, bias, fp16_gemm=True)
    assert projection.packed is not None and projection.weight is None
    out = projection(x)

    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 300)
    # A float32 sum of exact products (error at most n * 2^-24 * sum |x w|), rounded once to
    # bfloat16 (at most one bfloat16 step).
    float32_error = 200 * 2.0**-24 * F.linear(x.double().abs(), weight.double().abs())
    assert ((out.double() - exact).abs() <= bf16_ulp(exact) + float32_error).all()
    native = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    same = (out == native.to(torch.bfloat16)).float().mean().item()
    assert same > 0.98, f"only {same:.1%} equal to the float32 GEMM of the same weights"


@needs_fbgemm
def test_a_weight_beyond_float16_s_range_keeps_the_native_kernel() -> None:
    weight = torch.ones(8, 4, dtype=torch.bfloat16)
    weight[3, 1] = 1e6
    projection = Projection(weight, None, fp16_gemm=True)
    assert projection.packed is None
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    assert torch.equal(projection(x), F.linear(x, weight))


def test_the_kernel_choice() -> None:
    assert not use_fp16_gemm("native", torch.bfloat16, CPU)
    assert not use_fp16_gemm("auto", torch.float32, CPU)  # float32 models are never rounded
    capability = torch.backends.cpu.get_cpu_capability()
    has_bf16 = "BF16" in capability or "AMX" in capability
    assert use_fp16_gemm("auto", torch.bfloat16, CPU) == (fp16_gemm_available() and not has_bf16)
    with pytest.raises(ValueError, match="fbgemm-fp16"):
        use_fp16_gemm("fbgemm-fp16", torch.float32, CPU)
    with pytest.raises(ValueError, match="matmul must be one of"):
        EngineConfig(matmul="float32")
