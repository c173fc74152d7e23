"""Peak table, device-name detection and MFU that refuses unknown peaks."""

import warnings

import pytest

from hpc_tools.recipe.load import resolve
from profiling import peaks
from profiling.peaks import canonical_gpu, hfu, mfu, peak_for_recipe, peak_tflops


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H100 NVL", "H100-NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200-NVL"), ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("NVIDIA B200", "B200"), ("NVIDIA GB200", "GB200"),
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", None), ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
    ("AMD Instinct MI300X", "MI300X"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"),
    ("NVIDIA A10", "A10"), ("Tesla V100-SXM2-32GB", "V100-SXM"), ("h100-sxm", "H100-SXM"), ("A100-80GB", "A100-80GB"),
    ("NVIDIA GeForce RTX 3090", None), ("NVIDIA A10G", None), ("Mystery Accelerator", None),
])
def test_device_names(name, key):
    assert canonical_gpu(name) == key


def test_published_dense_figures_never_sparse():
    # docs/formulas.md: A100 312, H100 SXM 989, PCIe 756, NVL 835, H200 989, B200 2250, MI300X ~1300 (bf16, dense).
    for gpu, expected in [("A100-80GB", 312), ("H100-SXM", 989), ("H100-PCIe", 756), ("H100-NVL", 835),
                          ("H200", 989), ("B200", 2250), ("MI300X", 1300)]:
        assert peak_tflops(gpu, "bf16") == pytest.approx(expected, rel=0.01)
    for table in peaks.PEAK_TFLOPS.values():
        if "fp8" in table:  # fp8 is twice bf16 on every part that has it; a sparse figure would be 4x
            assert table["fp8"] == pytest.approx(2 * table["bf16"], rel=0.02)
        if "tf32" in table:
            assert table["tf32"] == pytest.approx(table["bf16"] / 2, rel=0.03)  # B200: 1.1 vs 2.25 PF


def test_unknown_gpu_gives_none_and_one_warning():
    peaks._warned.clear()
    with pytest.warns(UserWarning, match="gpu_peak_tflops"):
        assert peak_tflops("NVIDIA GeForce RTX 3090", "bf16") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second ask is silent
        assert peak_tflops("NVIDIA GeForce RTX 3090", "bf16") is None
        assert peak_tflops("cpu", "bf16") is None  # CPU ranks: no peak, no warning
    with pytest.warns(UserWarning, match="MIG slice"):
        assert peak_tflops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16") is None
    with pytest.warns(UserWarning, match="no dense fp8"):
        assert peak_tflops("A100-80GB", "fp8") is None
    with pytest.raises(ValueError):
        peak_tflops("H100-SXM", "int4")


def test_mfu_refuses_unknown_peak():
    assert mfu(1e15, 1.0, 8, None) is None
    assert hfu(1e15, 1.0, 8, None) is None
    assert mfu(989.4e12 * 8 * 0.5, 1.0, 8, 989.4) == pytest.approx(0.5)
    assert hfu(2e15, 2.0, 1, 1000.0) == pytest.approx(1.0)


def _recipe(**cluster):
    raw = {"name": "t", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                  "vocab_size": 128}, "cluster": {"nodes": 1, "gpus_per_node": 1, **cluster}}
    return resolve(raw, check=False)


def test_recipe_override_and_detection():
    assert peak_for_recipe(_recipe(gpu_type="H100-SXM")) == pytest.approx(989.4)
    assert peak_for_recipe(_recipe(gpu_type="H100-SXM"), device_name="NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_for_recipe(_recipe(gpu_type="weird", gpu_peak_tflops=123.0)) == 123.0
    peaks._warned.clear()
    with pytest.warns(UserWarning):
        assert peak_for_recipe(_recipe(gpu_type="weird")) is None
