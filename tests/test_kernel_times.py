"""The GPU step's kernel breakdown (``bench/gpu/kernel_times.py``): the kinds kernels are
sorted into and the per-step sums, on recorded (name, microseconds) pairs; the profiler itself
runs on a GPU only (``bench/gpu/step_times.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

GPU_BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu"


@pytest.fixture
def kernel_times(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(GPU_BENCH))
    import kernel_times

    return kernel_times


def test_kernels_are_sorted_into_products_triton_kernels_and_the_rest(kernel_times) -> None:
    kind_of = kernel_times.kind_of
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "gemm"
    assert kind_of("nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert kind_of("void gemv2T_kernel_val<int, int, __nv_bfloat16, 128>(...)") == "gemm"
    assert kind_of("cutlass3x_sm90_tensorop_gemm_bf16") == "gemm"
    assert kind_of("_decode_kernel") == "decode"
    assert kind_of("_context_attention_kernel") == "context_attention"
    assert kind_of("_rms_norm_kernel") == "rms_norm"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "other"
    assert kind_of("void at::native::index_elementwise_kernel<128, 4, ...>") == "other"


def test_two_steps_are_summed_per_step(kernel_times) -> None:
    step = [
        ("nvjet_gemm_a", 100.0),
        ("_rms_norm_kernel", 3.0),
        ("_rms_norm_kernel", 2.0),
        ("_decode_kernel", 10.0),
        ("vectorized_elementwise_kernel", 1.0),
    ]
    times = kernel_times.summarize_kernels(step * 2, steps=2)
    assert times.steps == 2
    assert times.kernels_per_step == 5
    assert times.device_ms_per_step == pytest.approx(0.116)
    assert times.ms_per_step_by_kind == {
        "gemm": 0.1,
        "decode": 0.01,
        "rms_norm": 0.005,
        "other": 0.001,
    }
    assert list(times.ms_per_step_by_kind) == ["gemm", "decode", "rms_norm", "other"]
    top = {share.name: share for share in times.top}
    assert top["_rms_norm_kernel"].launches_per_step == 2
    assert top["_rms_norm_kernel"].ms_per_step == pytest.approx(0.005)
    assert times.top[0].name == "nvjet_gemm_a"
    assert times.as_json()["top"][0]["kind"] == "gemm"
    with pytest.raises(ValueError):
        kernel_times.summarize_kernels(step, steps=0)


def test_the_profile_never_ends_the_run(kernel_times) -> None:
    """Where the profiler cannot give kernels (here: no CUDA), the result says why."""
    result = kernel_times.profile_steps(lambda: None, 1)
    assert set(result) == {"error"} and result["error"]
