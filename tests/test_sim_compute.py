"""The simulator's compute model (``sim/_compute.py``): the roofline by hand, every preset on every
GPU kind, MoE, sliding windows, recurrent state, calibration files, and the command line."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import TRACE

from kv_cache_manager_v2.sim import main
from kv_cache_manager_v2.sim._compute import (
    DEFAULT_MBU,
    DEFAULT_MFU,
    GPU_KINDS,
    MODEL_COMPUTE,
    CalibrationCost,
    RooflineCost,
    build_step_cost,
    load_calibration,
    model_compute,
)
from kv_cache_manager_v2.sim._models import PRESETS, SimUserError, model_shape
from kv_cache_manager_v2.sim._step_cost import LinearCost

SMALL_SHAPE = ("custom", 2, 1, 16)
SMALL = ["--model", "custom", "--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--tokens-per-block", "16"]
QUICK = [*SMALL, "--conversations", "4", "--turns", "2", "--system-tokens", "200", "--user-tokens", "50"]
QUICK += ["--output-tokens", "10", "--gpu", "20000tok", "--no-progress"]


def roofline(preset: str, gpu: str = "h100") -> RooflineCost:
    cost = build_step_cost(PRESETS[preset], gpu)
    assert isinstance(cost, RooflineCost)
    return cost


def test_llama_3_8b_on_h100_by_hand() -> None:
    """The roofline of llama-3-8b on H100 (SXM) at MFU 0.5, MBU 0.7, written out."""
    assert (DEFAULT_MFU, DEFAULT_MBU) == (0.5, 0.7)
    flops_s = 989.5e12 * 0.5  # dense BF16 peak x MFU
    bytes_s = 3.35e12 * 0.7  # HBM3 x MBU
    weights = 8.03e9 * 2  # bf16 parameters, read once a step
    kv_token = 2 * 32 * 8 * 128 * 2  # key + value x 32 layers x 8 KV heads x 128 x bf16 = 128 KiB
    attn = 4 * 32 * 128 * 32  # QK^T + AV: 4 x 32 query heads x head dim 128, per position, x 32 layers

    # one 2,048-token prefill, nothing cached: query i attends i + 1 positions
    cost = roofline("llama-3-8b")
    cost.add_prefill(2048, 0)
    flops = 2 * 8.03e9 * 2048 + 2048 * 2049 // 2 * attn  # 3.289e13 + 1.100e12
    nbytes = weights + 2048 * kv_token  # weights + the KV written
    assert flops / flops_s > nbytes / bytes_s  # compute-bound
    ms = cost.take_ms()
    assert ms == pytest.approx(1000 * flops / flops_s, rel=1e-12)
    assert ms == pytest.approx(68.70, abs=0.01)

    # a decode step of 256 requests, each after 1,024 tokens
    for _ in range(256):
        cost.add_decode(1024)
    flops = 2 * 8.03e9 * 256 + 256 * 1025 * attn  # 4.111e12 + 1.376e11
    nbytes = weights + 256 * 1024 * kv_token + 256 * kv_token  # weights + KV read + KV written
    assert nbytes / bytes_s > flops / flops_s  # memory-bound
    ms = cost.take_ms()
    assert ms == pytest.approx(1000 * nbytes / bytes_s, rel=1e-12)
    assert ms == pytest.approx(21.52, abs=0.01)
    assert cost.take_ms() == 0.0  # nothing left: a step without work takes no time


@pytest.mark.parametrize("gpu", sorted(GPU_KINDS))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_on_every_gpu(preset: str, gpu: str) -> None:
    assert preset in MODEL_COMPUTE
    cost = roofline(preset, gpu)
    times = []
    for context in (0, 4096, 65536):
        cost.add_prefill(2048, context)
        times.append(cost.take_ms())
    assert all(0 < t < math.inf for t in times)
    assert times[0] < times[1] < times[2]  # prefill time grows with the context
    for _ in range(64):
        cost.add_decode(8192)
    assert 0 < cost.take_ms() < math.inf


def test_a100_has_no_fp8_and_gpus_differ() -> None:
    assert GPU_KINDS["a100"].fp8_flops == GPU_KINDS["a100"].bf16_flops
    steps = {}
    for gpu in GPU_KINDS:
        cost = roofline("llama-3-8b", gpu)
        cost.add_decode(1000)
        steps[gpu] = cost.take_ms()
    assert steps["b200"] < steps["h200"] < steps["h100"] < steps["a100"] < steps["l40s"]  # HBM bandwidth order


def test_moe_computes_with_active_parameters() -> None:
    m = MODEL_COMPUTE["gpt-oss-120b"]
    cost = roofline("gpt-oss-120b")
    assert cost.flops_per_token == 2 * 5.1e9  # not 2 x 116.8e9
    # the routed experts: active = dense + experts x 4 / 128
    dense = m.params - m.expert_params
    assert dense + m.expert_params * 4 / 128 == pytest.approx(m.active)
    # one token reads the dense weights and its 4 experts of 128; many tokens all the experts
    cost.add_decode(0)
    _, one = cost.work()
    cost.take_ms()
    assert one - cost.kv_write == pytest.approx(cost.dense_bytes + cost.expert_bytes * 4 / 128)
    for _ in range(4096):
        cost.add_decode(0)
    _, many = cost.work()
    assert many - 4096 * cost.kv_write == pytest.approx(cost.dense_bytes + cost.expert_bytes)
    # MXFP4 experts: about 65 GB of weights in all (the published checkpoint's size)
    assert 60e9 < cost.dense_bytes + cost.expert_bytes < 70e9


def test_sliding_window_layers_are_capped() -> None:
    shape = PRESETS["gpt-oss-20b"]  # 12 of 24 layers slide over 128 tokens
    cost = roofline("gpt-oss-20b")
    w = cost.window
    assert w == 128 and cost.flops_per_swa == cost.flops_per_full > 0
    flops = []
    for context in (10**5, 2 * 10**5):
        cost.add_decode(context)
        flops.append(cost.work()[0])
        cost.take_ms()
    assert flops[1] - flops[0] == 10**5 * cost.flops_per_full  # only the full-attention layers grow
    # a prefill chunk's attended positions in a sliding-window layer: before, across, after the window
    for n, c in ((100, 0), (100, 20), (100, 28), (100, 50), (300, 5), (64, 1000), (1, 127), (1, 128)):
        cost.add_prefill(n, c)
        assert cost._swa == sum(min(p, w) for p in range(c + 1, c + n + 1)), (n, c)
        assert cost._full == n * c + n * (n + 1) // 2
        assert cost._swa_ctx == min(c, w)
        cost.take_ms()
    assert shape.num_swa_layers == 12


def test_hybrid_state_bytes_count() -> None:
    shape = PRESETS["nemotron-h-8b"]
    cost = roofline("nemotron-h-8b")
    cost.add_decode(0)
    flops, nbytes = cost.work()
    # each request reads and writes its recurrent state once a step
    assert nbytes == cost.dense_bytes + cost.kv_write + 2 * shape.state_bytes_per_request
    assert cost.flops_per_token == 2 * 8.1e9 + 4 * 24 * shape.ssm_state_elems  # + the state updates
    assert flops == cost.flops_per_token + 4 * 32 * 128 * 4  # one position in 4 attention layers


def test_custom_and_modified_shapes() -> None:
    # custom: the llama-3 architecture at that shape, so llama-3-8b's shape gives about its 8.03B
    custom = model_compute(model_shape("custom", 32, 8, 128))
    assert custom.params == pytest.approx(8.03e9, rel=0.01) and custom.query_heads == 32
    assert model_compute(model_shape("llama-3-70b", dtype="fp8")) is MODEL_COMPUTE["llama-3-70b"]
    deeper = model_compute(model_shape("llama-3-8b", layers=64))
    assert deeper.params > 1.8 * MODEL_COMPUTE["llama-3-8b"].params
    assert model_compute(replace(PRESETS["jamba-v0.1"], name="x")).experts == 0  # unknown name: derived


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "steps.csv"
    path.write_text(text)
    return str(path)


def test_calibration_fits_interpolates_and_extrapolates(tmp_path: Path) -> None:
    # measured: 5 ms + 0.01 ms a prefill token + 0.05 ms a decode token (columns in any order)
    rows = [(p, d, 5 + 0.01 * p + 0.05 * d) for p, d in ((0, 1), (0, 256), (2048, 0), (512, 64), (8192, 128))]
    text = "decode_tokens,step_ms,prefill_tokens\n" + "".join(f"{d},{ms},{p}\n" for p, d, ms in rows)
    cost = load_calibration(write(tmp_path, text + "\n"))
    assert cost.coefficients == pytest.approx((5.0, 0.01, 0.05), abs=1e-9)
    cost.add_prefill(1000, 300)  # between the rows
    for _ in range(10):
        cost.add_decode(2000)
    assert cost.take_ms() == pytest.approx(5 + 10 + 0.5)
    cost.add_prefill(100_000, 0)  # beyond them: along the same line
    assert cost.take_ms() == pytest.approx(5 + 1000)
    assert cost.take_ms() == 0.0
    # with the context column: its coefficient too
    text = "prefill_tokens,decode_tokens,context_tokens,step_ms\n" + "".join(
        f"{p},{d},{c},{2 + 0.01 * p + 0.04 * d + 0.001 * c}\n"
        for p, d, c in ((0, 8, 100), (0, 64, 9000), (1024, 0, 0), (512, 32, 50_000), (2048, 1, 7))
    )
    cost = load_calibration(write(tmp_path, text))
    assert cost.coefficients == pytest.approx((2.0, 0.01, 0.04, 0.001), abs=1e-9)
    cost.add_decode(10_000)
    assert cost.take_ms() == pytest.approx(2 + 0.04 + 10)
    assert isinstance(build_step_cost(PRESETS["qwen3-32b"], calibration=write(tmp_path, text)), CalibrationCost)
    # a byte-order mark (Excel's "CSV UTF-8") before the header is not part of its first name
    bom = tmp_path / "excel.csv"
    bom.write_bytes(text.encode("utf-8-sig"))
    assert load_calibration(str(bom)).coefficients == pytest.approx((2.0, 0.01, 0.04, 0.001), abs=1e-9)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty; write a header prefill_tokens,decode_tokens,step_ms"),
        ("prefill_tokens,step_ms\n1,2\n", "line 1: the header must name prefill_tokens, decode_tokens, step_ms"),
        ("prefill_tokens,decode_tokens,step_ms\n1,2,3\n4,x,6\n", "line 3: decode_tokens 'x' is not a number"),
        ("prefill_tokens,decode_tokens,step_ms\n1,2,3\n4,5\n", "line 3: 2 fields, the header has 3"),
        ("prefill_tokens,decode_tokens,step_ms\n1,2,-3\n", "line 2: step_ms must be a finite number >= 0, got -3"),
        ("prefill_tokens,decode_tokens,step_ms\n1,2,nan\n", "line 2: step_ms must be a finite number >= 0"),
        ("prefill_tokens,decode_tokens,step_ms\n1,2,3\n4,5,6\n", "2 measured rows cannot fit the step times"),
        ("prefill_tokens,decode_tokens,step_ms\n1,1,3\n2,2,5\n4,4,9\n", "vary prefill and decode tokens"),
    ],
)
def test_bad_calibration_files(tmp_path: Path, text: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SimUserError) as e:
        load_calibration(path)
    assert str(e.value).startswith(f"--calibration {path}: ") and says in str(e.value), str(e.value)
    with pytest.raises(SimUserError, match="cannot read it"):
        load_calibration(str(tmp_path / "missing.csv"))
    with pytest.raises(SimUserError, match="longer than 16 MiB"):
        load_calibration("/dev/zero")
    with pytest.raises(SimUserError, match="line 2: not CSV"):
        load_calibration(write(tmp_path, "prefill_tokens,decode_tokens,step_ms\n1," + "9" * 200_000 + ",3\n"))


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(list(args))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kv-cache-sim: error: "), (code, err)
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--step-ms", "10", "--gpu-kind", "h100"],
            "--step-ms/--tokens-per-s replace the compute model, which --gpu-kind",
        ),
        (["--tokens-per-s", "1e5", "--mfu", "0.4"], "which --mfu configure: drop one or the other"),
        (["--step-ms", "1", "--calibration", "x.csv"], "which --calibration configure"),
        (["--calibration", "x.csv", "--mbu", "0.5"], "--calibration replaces the roofline, which --mbu configure"),
        (["--gpu-kind", "tpu"], "unknown --gpu-kind 'tpu'; choose one of h100, h200, b200, a100, l40s"),
        (["--mfu", "0"], "--mfu must be in (0, 1] (a share of the peak), got 0"),
        (["--mbu", "1.5"], "--mbu must be in (0, 1] (a share of the peak), got 1.5"),
        (["--mfu", "nan"], "--mfu must be in (0, 1]"),
        (["--calibration", "/nonexistent/steps.csv"], "--calibration /nonexistent/steps.csv: cannot read it"),
    ],
)
def test_cli_refusals(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    assert says in one_line_error(capsys, *QUICK, *args)


def test_cli_records_the_step_cost(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main([*QUICK, "--gpu-kind", "a100", "--mbu", "0.6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    scheduler = json.loads(out.read_text())["scheduler"]
    assert scheduler["step_ms"] is None and scheduler["tokens_per_s"] is None  # not the model that ran
    compute = scheduler["compute"]
    weights = compute.pop("weights_bytes")
    assert weights == pytest.approx(2 * model_compute(model_shape(*SMALL_SHAPE)).params)  # bf16
    assert compute == {
        "model": "roofline",
        "gpu_kind": "a100",
        "mfu": DEFAULT_MFU,
        "mbu": 0.6,
        "hbm_bytes": 80 * 2**30,
        "warning": None,
        "text": "roofline on a100 (MFU 0.5, MBU 0.6)",
    }
    assert "roofline on a100 (MFU 0.5, MBU 0.6)" in text.splitlines()[0]
    assert main([*QUICK, "--step-ms", "3", "--json", str(out)]) == 0
    compute = json.loads(out.read_text())["scheduler"]["compute"]
    assert compute["model"] == "linear" and compute["step_ms"] == 3.0 and compute["tokens_per_s"] == 50_000.0
    calib = write(tmp_path, "prefill_tokens,decode_tokens,step_ms\n0,1,10\n0,100,20\n1000,0,30\n")
    assert main([*QUICK, "--calibration", calib, "--json", str(out)]) == 0
    compute = json.loads(out.read_text())["scheduler"]["compute"]
    assert compute["model"] == "calibration" and compute["path"] == calib
    capsys.readouterr()


#: decode-bound: 20 requests arrive within a second, then decode ~1,000 tokens each for tens of seconds
DECODING = ["--model", "llama-3-8b", "--conversations", "20", "--turns", "1", "--system-tokens", "200"]
DECODING += ["--user-tokens", "200", "--output-tokens", "1000", "--rate", "20", "--gpu", "8GiB", "--no-progress"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--gpu-kind", "l40s"], "tokens on one l40s (the roofline) for "),
        (["--calibration", "CALIB"], "tokens at the calibrated step times for "),
        (["--step-ms", "20"], "tokens at --tokens-per-s 50000 for "),
    ],
)
def test_overload_by_compute_says_so_for_every_cost_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], says: str
) -> None:
    """The load section's compute time is what the steps computed, whatever the cost model, and the
    overload warning names compute (not only GPU memory) when it is the limit."""
    calib = write(tmp_path, "prefill_tokens,decode_tokens,step_ms\n0,1,25\n0,100,30\n1000,0,40\n")
    out = tmp_path / "r.json"
    assert main([*DECODING, *[calib if a == "CALIB" else a for a in args], "--json", str(out)]) == 0
    capsys.readouterr()
    load = json.loads(out.read_text())["load"]
    assert load["overloaded"] and 0.9 * load["trace_span_s"] < load["compute_s"] <= load["simulated_s"]
    assert load["simulated_s"] - load["compute_s"] < 1.0  # the steps computed all the time after the arrivals
    assert any(says in w for w in load["warnings"]), load["warnings"]


def test_weights_beyond_one_gpu_warn_but_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The roofline assumes one GPU: the model's weights plus the GPU tier past its memory (the
    datasheet's) is a warning (JSON and text), not a refusal."""
    assert {k: g.hbm_bytes / 2**30 for k, g in GPU_KINDS.items()} == {
        "h100": 80,
        "h200": 141,
        "b200": 180,
        "a100": 80,
        "l40s": 48,
    }
    out = tmp_path / "r.json"
    args = ["--trace", TRACE, "--requests", "5", "--no-progress", "--json", str(out)]
    for model, gpu, warns in (
        ("llama-3-8b", "40GiB", False),
        ("llama-3-8b", "70GiB", True),
        ("llama-3-70b", "8GiB", True),
    ):
        assert main([*args, "--model", model, "--gpu", gpu]) == 0
        text = capsys.readouterr().out
        compute = json.loads(out.read_text())["scheduler"]["compute"]
        weights = roofline(model).weights_bytes
        assert compute["weights_bytes"] == weights and weights == pytest.approx(2 * MODEL_COMPUTE[model].params)
        assert (compute["warning"] is not None) is warns, (model, gpu)
        assert ("tensor parallelism is not modelled" in text) is warns
    assert compute["warning"] == (
        "the model's weights (132 GiB) plus the GPU tier (8 GiB) exceed one h100's 80 GiB: "
        "the roofline assumes one GPU; tensor parallelism is not modelled"
    )


def test_linear_is_the_explicit_override() -> None:
    cost = build_step_cost(PRESETS["llama-3-8b"], linear=(15.0, 50_000.0))
    assert isinstance(cost, LinearCost)
    cost.add_prefill(1000, 0)
    assert cost.take_ms() == pytest.approx(35.0)


def test_step_ms_replays_as_before_the_roofline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--step-ms 15`` is the time model from before the roofline: test_sim_figures' "full" setup
    replays as it did then (its pinned digest before the roofline: 0a2e31953cd59fa7)."""
    out = tmp_path / "r.json"
    args = ["--trace", TRACE, "--no-progress", "--requests", "80", "--time-scale", "0.05", "--gpu", "2GiB"]
    assert main([*args, "--step-ms", "15", "--json", str(out)]) == 0
    capsys.readouterr()
    rep = json.loads(out.read_text())
    assert rep["replay"]["steps"] == 9439 and rep["replay"]["simulated_s"] == pytest.approx(153.04736)
    assert rep["hit_rate"]["blocks"] == pytest.approx(0.10009427161315367, abs=1e-15)
    assert rep["preemptions"] == {"suspend": 45, "recompute": 13, "resumed": 32}
