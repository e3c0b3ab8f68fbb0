"""The projections' kernels for a bfloat16 model on a CPU: oneDNN's prepacked bfloat16 GEMM
(F.linear's results exactly), FBGEMM's float16 GEMM (the same products as a bfloat16 GEMM that
sums in float32), and the choice between them."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from kvbaton.cli.main import build_parser
from kvbaton.cli.worker import ENGINE_FLAGS, WORKER_FLAGS
from kvbaton.engine import EngineConfig
from kvbaton.engine.config import MATMULS
from kvbaton.engine.model import (
    FEW_ROWS,
    Projection,
    amx_available,
    fp16_gemm_available,
    onednn_bf16_available,
)
from kvbaton.engine.model_runner import projection_kernel

needs_fbgemm = pytest.mark.skipif(not fp16_gemm_available(), reason="FBGEMM is x86 only")
needs_onednn = pytest.mark.skipif(
    not onednn_bf16_available(), reason="oneDNN has no bfloat16 GEMMs on this CPU"
)
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

    projection = Projection(weight, bias, "fbgemm-fp16")
    assert projection.fp16 is not None and projection.weight is None
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
    projection = Projection(weight, None, "fbgemm-fp16")
    assert projection.fp16 is None
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    assert torch.equal(projection(x), F.linear(x, weight))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_prepacked_gemm_equals_f_linear_bit_for_bit(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(320, 200, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(320, generator=gen).to(torch.bfloat16) if with_bias else None
    projection = Projection(weight, bias, "onednn-bf16")
    assert projection.onednn is not None and projection.weight is None
    x = torch.randn(rows, 400, generator=gen).to(torch.bfloat16)[:, 100:300]  # strided rows
    out = projection(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 320)
    assert torch.equal(out, F.linear(x, weight, bias))


@needs_onednn
@needs_fbgemm
def test_the_hybrid_runs_few_rows_on_fbgemm_and_more_on_onednn() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(320, 200, generator=gen) * 0.05).to(torch.bfloat16)
    hybrid = Projection(weight, None, "fbgemm-fp16+onednn-bf16")
    fbgemm = Projection(weight, None, "fbgemm-fp16")
    for rows in (1, FEW_ROWS - 1, FEW_ROWS, 64):
        x = torch.randn(rows, 200, generator=gen).to(torch.bfloat16)
        expected = fbgemm(x) if rows < FEW_ROWS else F.linear(x, weight)
        assert torch.equal(hybrid(x), expected)
    weight[3, 1] = 1e6  # beyond float16: oneDNN for every call
    hybrid = Projection(weight, None, "fbgemm-fp16+onednn-bf16")
    assert hybrid.fp16 is None
    x = torch.randn(2, 200, generator=gen).to(torch.bfloat16)
    assert torch.equal(hybrid(x), F.linear(x, weight))


def test_the_kernel_choice() -> None:
    assert projection_kernel("native", torch.bfloat16, CPU) == "native"
    assert projection_kernel("auto", torch.float32, CPU) == "native"  # float32 is never rounded
    usable = [
        kernel
        for kernel, ok in (
            ("fbgemm-fp16", fp16_gemm_available()),
            ("onednn-bf16", onednn_bf16_available()),
        )
        if ok
    ]
    auto = "onednn-bf16" if "onednn-bf16" in usable and amx_available() else "+".join(usable)
    assert projection_kernel("auto", torch.bfloat16, CPU) == (auto or "native")
    for kernel in usable:
        assert projection_kernel(kernel, torch.bfloat16, CPU) == kernel
    for kernel in ("fbgemm-fp16", "onednn-bf16", "fbgemm-fp16+onednn-bf16"):
        with pytest.raises(
            ValueError, match=re.escape(f"matmul '{kernel}' needs a bfloat16 model")
        ):
            projection_kernel(kernel, torch.float32, CPU)
    with pytest.raises(ValueError, match="matmul must be one of"):
        EngineConfig(matmul="float32")
    with pytest.raises(ValueError, match="kernel must be one of"):
        Projection(torch.ones(2, 2), None, "float32")


def test_the_worker_flag_offers_every_kernel_and_reaches_the_engine_config() -> None:
    parser = build_parser()
    for choice in MATMULS:
        args = parser.parse_args(["worker", "--matmul", choice])
        values = {n: getattr(args, n) for n in ENGINE_FLAGS if getattr(args, n) is not None}
        assert EngineConfig(**values).matmul == choice
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--matmul", "float32"])
    assert "matmul" in WORKER_FLAGS  # serve passes it on to its workers
