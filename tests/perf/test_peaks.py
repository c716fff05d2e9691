"""The device peak table and the CPU matmul measurement (lightning_ext.perf.peaks)."""

import re

import pytest
import torch

import lightning_ext
from lightning_ext.perf import DEVICE_PEAKS, clear_peak_cache, measure_peak_flops, peak_flops


@pytest.mark.parametrize(
    ("device_name", "dtype", "tflops"),
    [
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312),
        ("NVIDIA A100 80GB PCIe", "tf32", 156),
        ("NVIDIA H100 80GB HBM3", torch.float16, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756),
        ("NVIDIA H100 NVL", torch.bfloat16, 835.5),
        ("NVIDIA H200", torch.float8_e4m3fn, 1978.9),
        ("NVIDIA H200 NVL", torch.float8_e5m2, 1670.5),
        ("NVIDIA B200", torch.bfloat16, 2250),
        ("NVIDIA GB200", torch.bfloat16, 2500),  # not B200's entry
        ("NVIDIA L4", torch.float8_e4m3fn, 242.5),
        ("NVIDIA L40S", torch.bfloat16, 362.05),  # not L4's entry
        ("AMD Instinct MI300X", torch.float8_e4m3fnuz, 2614.9),
        ("AMD Instinct MI325X", "fp32", 163.4),
    ],
)
def test_peak_from_the_device_name(device_name, dtype, tflops):
    assert peak_flops(dtype, device_name) == pytest.approx(tflops * 1e12, rel=1e-12)


@pytest.mark.parametrize("device_name", ["NVIDIA RTX A1000 Laptop GPU", "NVIDIA RTX A1000 6GB Laptop GPU"])
def test_a_model_number_is_matched_whole(device_name):
    # "A100" matched inside "A1000": a laptop GPU got the A100's 312 TFLOP/s, its MFU 100x low.
    with pytest.raises(ValueError, match=r"no peak known for the device"):
        peak_flops(torch.bfloat16, device_name)
    assert peak_flops(torch.bfloat16, "NVIDIA A100X") == 312e12  # (a suffix letter is the same chip)


_MIG_SLICES = ["NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA H100 80GB HBM3 MIG 3g.40gb"]


@pytest.mark.parametrize("device_name", _MIG_SLICES)
def test_a_mig_slice_has_no_datasheet_peak(device_name):
    # It got the whole GPU's peak: the MFU of a 1g slice read 7x low.
    with pytest.raises(ValueError, match=r"a MIG instance.* share of the GPU's .* HINT: give the peak"):
        peak_flops(torch.bfloat16, device_name)


def test_fp8_is_its_own_column_never_int8s():
    # fp8 is asked for and answered (twice bf16 on Hopper), and a device without an fp8 unit refuses
    # instead of falling back to another column.
    fp8 = peak_flops(torch.float8_e4m3fn, "NVIDIA H100 80GB HBM3")
    assert fp8 == pytest.approx(2 * peak_flops("bf16", "H100 SXM"), rel=1e-4)
    with pytest.raises(
        ValueError, match=r"A100 .*has no fp8 unit; it has \['bf16', 'fp16', 'fp32', 'tf32'\]"
    ):
        peak_flops(torch.float8_e4m3fn, "NVIDIA A100-SXM4-40GB")


def test_float32_reads_tf32_unless_matmul_precision_is_highest():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_flops(torch.float32, "NVIDIA A100-SXM4-80GB") == 19.5e12
        torch.set_float32_matmul_precision("high")
        assert peak_flops(torch.float32, "NVIDIA A100-SXM4-80GB") == 156e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_float32_reads_torchs_new_fp32_precision_setting_too():
    # Set beside the legacy default, it makes torch.get_float32_matmul_precision() raise: Throughput's
    # start of training died there.
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no torch.backends.cuda.matmul.fp32_precision")
    previous = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert peak_flops(torch.float32, "NVIDIA A100-SXM4-80GB") == 156e12
        matmul.fp32_precision = "ieee"
        assert peak_flops(torch.float32, "NVIDIA A100-SXM4-80GB") == 19.5e12
    finally:
        matmul.fp32_precision = previous


def test_measuring_on_a_device_whose_timing_would_not_wait_for_it_raises():
    with pytest.raises(ValueError, match=r"`device` must be a CPU or an available GPU, got 'mps'"):
        measure_peak_flops(torch.float32, "mps")


def test_unknown_device_and_dtype_raise_with_a_hint():
    with pytest.raises(ValueError, match=r"no peak known for the device 'Radeon 7'\. HINT: give the peak"):
        peak_flops(torch.bfloat16, "Radeon 7")
    with pytest.raises(ValueError, match=r"`dtype` must be float32, bfloat16, float16 or a float8 dtype"):
        peak_flops(torch.int8, "NVIDIA H100")
    with pytest.raises(ValueError, match=r"`dtype` must be a torch dtype or one of .*got 'int8'"):
        peak_flops("int8", "NVIDIA H100")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device and no `device_name`"):
            peak_flops(torch.bfloat16)


def test_every_entry_names_its_source_and_is_dense():
    for entry in DEVICE_PEAKS:
        assert "datasheet" in entry.source or "whitepaper" in entry.source, entry
        re.compile(entry.pattern)
        # Dense figures: bf16 at most 2x tf32 where both exist (the sparse ones would be 2x larger).
        if "tf32" in entry.flops:
            assert entry.flops["bf16"] == pytest.approx(2 * entry.flops["tf32"], rel=0.03), entry.name


def test_measured_once_per_process_until_reset():
    clear_peak_cache()
    first = measure_peak_flops(torch.float32, "cpu", size=128)
    assert first > 1e6  # any CPU multiplies faster than a million FLOP/s
    assert measure_peak_flops(torch.float32, "cpu", size=128) == first  # cached, not measured again
    lightning_ext.perf.clear_peak_cache()
    assert measure_peak_flops(torch.float32, "cpu", size=128) != first  # measured anew (timings differ)


def test_measure_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"measure_peak_flops: `size` must be an int >= 16, got 8"):
        measure_peak_flops(torch.float32, size=8)
    with pytest.raises(TypeError, match=r"`size` must be an int >= 16, got 64.0 \(float\)"):
        measure_peak_flops(torch.float32, size=64.0)
    with pytest.raises(ValueError, match=r"`dtype` must be one of .*got torch.float8_e4m3fn"):
        measure_peak_flops(torch.float8_e4m3fn)
