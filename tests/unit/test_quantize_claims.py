"""What the quantize schemes claim (issue 46 item 11): torchao 0.18's weight-only int8 and fp8 layers cast or
dequantize their weights to the activations' precision and run an ordinary GEMM there, so fp8 needs no float8 units
(no compute capability 8.9) and neither is faster without ``torch.compile``: they save memory. The layers are run
here on CPU against that description; the one line ``quantize`` prints for a bad scheme says the same."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
torchao_quant = pytest.importorskip("torchao.quantization")


@pytest.mark.parametrize("scheme", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
def test_a_weight_only_layer_is_a_gemm_at_the_activations_precision_on_the_dequantized_weights(scheme):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    torchao_quant.quantize_(layer, getattr(torchao_quant, scheme)())
    weight = layer.weight
    assert weight.qdata.element_size() == 1  # stored at 8 bits
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    reference = x @ weight.dequantize().to(torch.bfloat16).t()
    assert torch.allclose(out.float(), reference.float(), rtol=2e-2, atol=2e-2)


def test_the_bad_scheme_line_claims_no_speed_and_no_compute_capability():
    from hpc_tools.errors import UserError
    from hpc_tools.evaluate.quantize import check

    with pytest.raises(UserError) as err:
        check(None, "int4")
    line = str(err.value)
    assert "8.9" not in line and "fast" not in line and "save memory, not time" in line, line
