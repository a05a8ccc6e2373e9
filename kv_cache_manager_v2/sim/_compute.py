"""What decides a simulated step's compute time: GPU kinds, the models' compute parameters, the
roofline :class:`StepCost`, the calibration-file :class:`StepCost`, and the factory of both.

**Roofline.** A step's work is the sum of its requests' (``add_prefill``/``add_decode``); its time is
the larger of the compute-bound time (FLOPs / (peak FLOP/s x MFU)) and the memory-bound time
(bytes / (HBM bandwidth x MBU)):

- FLOPs = 2 x active parameters x tokens (+ 4 x recurrent state elements per token and recurrent
  layer for hybrids) + attention: 4 x query heads x head dim per attended (query, key) position and
  attention layer (QK^T and AV). A prefill chunk of n tokens after c attends n*c + n(n+1)/2
  positions; a decode token after c attends c + 1; a sliding-window layer at most window + sinks
  per query.
- Bytes = the weights read once per step (a MoE's routed experts: the share a step's tokens are
  expected to touch under uniform routing, 1 - (1 - k/E)^tokens, so never more than all of them)
  + the KV read (each request's context once per attention layer, sliding-window layers capped at
  their window) + the KV written (its new tokens) + for hybrids each request's recurrent state
  read and written once per step.

A step with no work takes no time. Per request, ``add_*`` does a few integer operations; the
floating-point work is once per step (``take_ms``).

**Calibration file** (``--calibration FILE``): measured step times by batch shape, as an engine's
profiler writes them: CSV with a header naming ``prefill_tokens``, ``decode_tokens``, ``step_ms``
and optionally ``context_tokens`` (the sum over the step's requests of the tokens already in their
KV cache), one row per measured step. The simulator fits step_ms = a + b x prefill_tokens + c x
decode_tokens (+ d x context_tokens) by least squares (the linear batch model of llm-d's BLIS),
which interpolates between the rows and extrapolates along the same lines (a prediction below 0 is
0). It needs as many rows as coefficients, with prefill and decode tokens varying independently.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from typing import Final

import numpy as np

from ._models import DTYPE_BYTES, PRESETS, ModelShape, SimUserError, format_bytes
from ._step_cost import LinearCost, StepCost


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind's peaks: dense (no sparsity) tensor-core FLOP/s, HBM bandwidth and the host link
    (one direction), in FLOP/s and bytes/s; and its memory (HBM, bytes, as its datasheet states it)."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float
    hbm_bytes: float


T: Final = 1e12
GiB: Final = float(1 << 30)
#: the GPUs of ``--gpu-kind`` (SXM parts where there is one). Host links: PCIe x16, one direction.
#: Memory: the datasheet's "GB", which are GiB (an H100's 80 GB are 5 HBM3 stacks of 16 GiB).
GPU_KINDS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 1,979 / FP8 3,958 TFLOPS with sparsity
        # (half dense), 3.35 TB/s HBM3, PCIe Gen5 128 GB/s (both directions), 80 GB
        GpuSpec("h100", 989.5 * T, 1979 * T, 3.35 * T, 64e9, 80 * GiB),
        # NVIDIA H200 datasheet, H200 SXM: the H100's tensor cores, 4.8 TB/s HBM3e, PCIe Gen5 128 GB/s,
        # 141 GB
        GpuSpec("h200", 989.5 * T, 1979 * T, 4.8 * T, 64e9, 141 * GiB),
        # NVIDIA HGX B200 (1,000 W) specifications: BF16 4.5 / FP8 9 PFLOPS with sparsity (half
        # dense), 8 TB/s HBM3e, 180 GB per GPU; HGX B200 hosts link it at PCIe Gen5 (64 GB/s one way)
        GpuSpec("b200", 2250 * T, 4500 * T, 8.0 * T, 64e9, 180 * GiB),
        # NVIDIA A100 Tensor Core GPU datasheet, A100 SXM 80GB: BF16 312 TFLOPS dense, no FP8 (BF16
        # given for it), 2,039 GB/s HBM2e, PCIe Gen4 64 GB/s (both directions), 80 GB
        GpuSpec("a100", 312 * T, 312 * T, 2.039 * T, 32e9, 80 * GiB),
        # NVIDIA L40S datasheet (PCIe card): BF16 362.05 / FP8 733 TFLOPS dense, 864 GB/s GDDR6,
        # PCIe Gen4 x16 64 GB/s (both directions), 48 GB
        GpuSpec("l40s", 362.05 * T, 733 * T, 0.864 * T, 32e9, 48 * GiB),
    )
}
DEFAULT_GPU_KIND = "h100"
#: Model FLOPs utilisation of a compute-bound step: about half the dense peak, what large dense
#: matmul workloads are published at (PaLM: 46.2 % MFU, Chowdhery et al. 2022); an assumption to
#: replace by a measurement (--mfu, or --calibration)
DEFAULT_MFU = 0.5
#: Memory-bandwidth utilisation of a memory-bound (decode) step: Databricks' "LLM Inference
#: Performance Engineering: Best Practices" (2023) reports 60-70 % for a 7B model at batch 1
DEFAULT_MBU = 0.7
#: bytes of one MXFP4 parameter (4 bits + one 8-bit scale per 32: gpt-oss's MoE weights)
MXFP4_BYTES = 4.25 / 8


@dataclass(frozen=True)
class ModelCompute:
    """A model's compute parameters (published: model cards and config.json). MoE: ``experts``
    routed experts per layer, ``top_k`` of them per token; ``expert_dtype`` their weights'."""

    params: float  #: all parameters
    active: float  #: parameters a token computes with (MoE: the routed top-k, shared parts included)
    query_heads: int  #: attention heads (query) of each attention layer
    weight_dtype: str = "bf16"
    experts: int = 0
    top_k: int = 0
    expert_dtype: str = "bf16"

    @property
    def expert_params(self) -> float:
        """Parameters of the routed experts: active = dense + experts x top_k / experts."""
        if not self.experts:
            return 0.0
        return (self.params - self.active) / (1.0 - self.top_k / self.experts)

    def weight_bytes(self) -> tuple[float, float]:
        """(bytes of the dense part, bytes of the routed experts)."""
        x = self.expert_params
        per_expert_param = MXFP4_BYTES if self.expert_dtype == "mxfp4" else DTYPE_BYTES[self.expert_dtype]
        return (self.params - x) * DTYPE_BYTES[self.weight_dtype], x * per_expert_param


B: Final = 1e9
#: preset -> compute parameters (sources: each model's card / config.json on Hugging Face)
MODEL_COMPUTE: dict[str, ModelCompute] = {
    # meta-llama/Meta-Llama-3-8B: 8.03B; num_attention_heads 32
    "llama-3-8b": ModelCompute(8.03 * B, 8.03 * B, 32),
    # meta-llama/Meta-Llama-3-70B: 70.6B; num_attention_heads 64
    "llama-3-70b": ModelCompute(70.6 * B, 70.6 * B, 64),
    # Qwen/Qwen2.5-7B: 7.61B; num_attention_heads 28
    "qwen2.5-7b": ModelCompute(7.61 * B, 7.61 * B, 28),
    # Qwen/Qwen3-32B: 32.8B; num_attention_heads 64
    "qwen3-32b": ModelCompute(32.8 * B, 32.8 * B, 64),
    # openai/gpt-oss-20b: 21B, 3.6B active; num_attention_heads 64; 32 local experts, 4 per token,
    # MoE weights in MXFP4 (the rest bf16)
    "gpt-oss-20b": ModelCompute(20.9 * B, 3.6 * B, 64, "bf16", 32, 4, "mxfp4"),
    # openai/gpt-oss-120b: 117B, 5.1B active; num_attention_heads 64; 128 experts, 4 per token, MXFP4
    "gpt-oss-120b": ModelCompute(116.8 * B, 5.1 * B, 64, "bf16", 128, 4, "mxfp4"),
    # Qwen/Qwen3-Next-80B-A3B: 80B, 3B active; num_attention_heads 16; num_experts 512,
    # num_experts_per_tok 10 (+ a shared expert)
    "qwen3-next-80b-a3b": ModelCompute(80 * B, 3 * B, 16, "bf16", 512, 10),
    # nvidia/Nemotron-H-8B-Base-8K: 8B dense; num_attention_heads 32
    "nemotron-h-8b": ModelCompute(8.1 * B, 8.1 * B, 32),
    # ai21labs/Jamba-v0.1: 52B, 12B active; num_attention_heads 32; num_experts 16, 2 per token
    "jamba-v0.1": ModelCompute(52 * B, 12 * B, 32, "bf16", 16, 2),
    # tiiuae/Falcon-H1-7B-Base: 7.6B dense; num_attention_heads 12
    "falcon-h1-7b": ModelCompute(7.6 * B, 7.6 * B, 12),
    # ibm-granite/granite-4.0-h-small: 32B, 9B active; num_attention_heads 32; num_local_experts 72,
    # num_experts_per_tok 10 (+ a shared expert)
    "granite-4.0-h-small": ModelCompute(32 * B, 9 * B, 32, "bf16", 72, 10),
}
#: ``--model custom`` (or a preset with --layers/--kv-heads/--head-dim changed): the llama-3
#: architecture at that shape: query heads = 4 x KV heads, hidden = query heads x head dim, an MLP
#: of 3.5 x hidden (gate, up, down), untied 128,256-token embeddings
CUSTOM_GQA = 4
CUSTOM_MLP = 3.5
CUSTOM_VOCAB = 128_256


def model_compute(shape: ModelShape) -> ModelCompute:
    """The compute parameters of ``shape``: its preset's, else derived (see ``CUSTOM_GQA``)."""
    base = PRESETS.get(shape.name.removesuffix(" (modified)"))
    if base is not None and (base.num_layers, base.kv_heads, base.head_dim) == (
        shape.num_layers,
        shape.kv_heads,
        shape.head_dim,
    ):
        return MODEL_COMPUTE[base.name]
    q = CUSTOM_GQA * shape.kv_heads
    hidden = q * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * CUSTOM_MLP * hidden * hidden
    params = shape.num_layers * per_layer + 2.0 * CUSTOM_VOCAB * hidden
    return ModelCompute(params, params, q)


class RooflineCost(StepCost):
    """A step's time: the larger of its compute-bound and memory-bound time (see the module doc)."""

    def __init__(self, shape: ModelShape, gpu: GpuSpec, mfu: float = DEFAULT_MFU, mbu: float = DEFAULT_MBU) -> None:
        m = model_compute(shape)
        self.model = m
        self.gpu = gpu
        self.mfu = mfu
        self.mbu = mbu
        n_swa = shape.num_swa_layers
        n_full = len(shape.kv_layers) - n_swa
        attn = 4.0 * m.query_heads * shape.head_dim  # QK^T + AV, per position and layer
        kv_token = 2.0 * shape.buffer_bytes_per_token  # key + value, one layer
        #: the window a sliding-window layer attends (0: none)
        self.window = (shape.window or 0) + shape.sinks if n_swa else 0
        rec_flops = 4.0 * len(shape.recurrent_layers) * shape.ssm_state_elems
        self.flops_per_token = 2.0 * m.active + rec_flops
        self.flops_per_full = attn * n_full
        self.flops_per_swa = attn * n_swa
        self.kv_read_full = kv_token * n_full
        self.kv_read_swa = kv_token * n_swa
        self.kv_write = kv_token * (n_full + n_swa)
        self.state_bytes = 2.0 * shape.state_bytes_per_request  # read and written
        self.dense_bytes, self.expert_bytes = m.weight_bytes()
        self.weights_bytes = self.dense_bytes + self.expert_bytes  #: all of them, on this one GPU
        self.expert_miss = 1.0 - m.top_k / m.experts if m.experts else 0.0
        dtype = m.expert_dtype if m.experts else m.weight_dtype
        peak = gpu.fp8_flops if dtype == "fp8" else gpu.bf16_flops
        self.flop_ms = 1000.0 / (peak * mfu)
        self.byte_ms = 1000.0 / (gpu.hbm_bytes_per_s * mbu)
        self._tokens = 0
        self._requests = 0
        self._full = 0  #: (query, key) positions attended in a full-attention layer
        self._swa = 0  #: in a sliding-window layer
        self._ctx = 0  #: context tokens read per full-attention layer
        self._swa_ctx = 0  #: per sliding-window layer

    def add_prefill(self, tokens: int, context: int) -> None:
        n = tokens
        c = context
        self._tokens += n
        self._requests += 1
        self._full += n * c + n * (n + 1) // 2
        self._ctx += c
        w = self.window
        if w:
            if c + n <= w:
                self._swa += n * c + n * (n + 1) // 2
            elif c >= w:
                self._swa += n * w
            else:  # queries up to position w attend all before them, the rest w
                self._swa += (w * (w + 1) - c * (c + 1)) // 2 + (c + n - w) * w
            self._swa_ctx += c if c < w else w

    def add_decode(self, context: int) -> None:
        self._tokens += 1
        self._requests += 1
        self._full += context + 1
        self._ctx += context
        w = self.window
        if w:
            self._swa += context + 1 if context < w else w
            self._swa_ctx += context if context < w else w

    def work(self) -> tuple[float, float]:
        """(FLOPs, bytes) of the work added since the last ``take_ms``."""
        tokens = self._tokens
        if not tokens:
            return 0.0, 0.0
        flops = tokens * self.flops_per_token + self._full * self.flops_per_full + self._swa * self.flops_per_swa
        weights = self.dense_bytes
        if self.expert_bytes:
            weights += self.expert_bytes * (1.0 - self.expert_miss**tokens)
        nbytes = (
            weights
            + self._ctx * self.kv_read_full
            + self._swa_ctx * self.kv_read_swa
            + tokens * self.kv_write
            + self._requests * self.state_bytes
        )
        return flops, nbytes

    def take_ms(self) -> float:
        flops, nbytes = self.work()
        self._tokens = self._requests = self._full = self._swa = self._ctx = self._swa_ctx = 0
        compute = flops * self.flop_ms
        memory = nbytes * self.byte_ms
        return compute if compute > memory else memory


#: the columns of a calibration file, the optional one last
CALIBRATION_COLUMNS = ("prefill_tokens", "decode_tokens", "step_ms")
CONTEXT_COLUMN = "context_tokens"
#: the longest calibration file read (characters): a profile has at most thousands of rows
MAX_CALIBRATION_CHARS = 16 << 20


class CalibrationCost(StepCost):
    """Measured step times, fitted as step_ms = a + b x prefill + c x decode (+ d x context) (see the
    module doc); ``coefficients`` (a, b, c[, d])."""

    def __init__(self, coefficients: tuple[float, ...], path: str = "") -> None:
        self.coefficients = coefficients
        self.path = path
        self.a = coefficients[0]
        self.b = coefficients[1]
        self.c = coefficients[2]
        self.d = coefficients[3] if len(coefficients) > 3 else 0.0
        self._prefill = 0
        self._decode = 0
        self._context = 0

    def add_prefill(self, tokens: int, context: int) -> None:
        self._prefill += tokens
        self._context += context

    def add_decode(self, context: int) -> None:
        self._decode += 1
        self._context += context

    def take_ms(self) -> float:
        if not self._prefill and not self._decode:
            return 0.0
        ms = self.a + self.b * self._prefill + self.c * self._decode + self.d * self._context
        self._prefill = self._decode = self._context = 0
        return ms if ms > 0.0 else 0.0


def load_calibration(path: str) -> CalibrationCost:
    """Read and fit a calibration file (see the module doc); SimUserError naming the line if bad."""
    where = f"--calibration {path}"
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # (-sig: a byte-order mark, as Excel writes)
            text = f.read(MAX_CALIBRATION_CHARS + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise SimUserError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if len(text) > MAX_CALIBRATION_CHARS:
        raise SimUserError(f"{where}: longer than {MAX_CALIBRATION_CHARS >> 20} MiB; is this a CSV of measured steps?")
    reader = csv.reader(text.splitlines())
    rows: list[list[str]] = []
    try:
        for row in reader:
            rows.append(row)
    except csv.Error as e:  # a NUL byte, a field beyond csv's limit
        raise SimUserError(f"{where}: line {reader.line_num}: not CSV ({e})") from None
    if not rows:
        raise SimUserError(f"{where}: empty; write a header {','.join(CALIBRATION_COLUMNS)}[,{CONTEXT_COLUMN}]")
    header = [h.strip() for h in rows[0]]
    wanted = [*CALIBRATION_COLUMNS, *([CONTEXT_COLUMN] if CONTEXT_COLUMN in header else [])]
    missing = [c for c in CALIBRATION_COLUMNS if c not in header]
    if missing or len(set(header)) != len(header):
        raise SimUserError(
            f"{where}: line 1: the header must name {', '.join(CALIBRATION_COLUMNS)} (and optionally "
            f"{CONTEXT_COLUMN}) once each, got {','.join(header)!r}"
        )
    index = [header.index(c) for c in wanted]
    xs: list[list[float]] = []
    ys: list[float] = []
    for line, row in enumerate(rows[1:], start=2):
        if not row or all(not x.strip() for x in row):
            continue
        if len(row) != len(header):
            raise SimUserError(f"{where}: line {line}: {len(row)} fields, the header has {len(header)}")
        values: list[float] = []
        for col, i in zip(wanted, index):
            try:
                v = float(row[i])
            except ValueError:
                raise SimUserError(f"{where}: line {line}: {col} {row[i].strip()!r} is not a number") from None
            if not 0.0 <= v < math.inf:
                raise SimUserError(f"{where}: line {line}: {col} must be a finite number >= 0, got {row[i].strip()}")
            values.append(v)
        xs.append([1.0, values[0], values[1], *values[3:]])
        ys.append(values[2])
    return CalibrationCost(_fit(xs, ys, where), path)


def _fit(xs: list[list[float]], ys: list[float], where: str) -> tuple[float, ...]:
    """Least squares of the step times ``ys`` on the rows ``xs`` (``numpy.linalg.lstsq``)."""
    k = len(xs[0]) if xs else len(CALIBRATION_COLUMNS)
    names = "the step times of (prefill, decode" + (", context" if k > 3 else "") + ") batches"
    if len(xs) < k:
        raise SimUserError(f"{where}: {len(xs)} measured rows cannot fit {names}: give at least {k}")
    coefficients, _, rank, _ = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)
    if rank < k:
        raise SimUserError(
            f"{where}: its rows cannot fit {names}: vary prefill and decode tokens "
            "(and context) independently across rows"
        )
    return tuple(float(c) for c in coefficients)


def build_step_cost(
    shape: ModelShape,
    gpu_kind: str | None = None,
    mfu: float | None = None,
    mbu: float | None = None,
    calibration: str | None = None,
    linear: tuple[float, float] | None = None,
) -> StepCost:
    """The step cost of a run: ``linear`` (step_ms, tokens_per_s: ``--step-ms``/``--tokens-per-s``)
    where given, else the calibration file's where given, else the roofline of ``shape`` on
    ``gpu_kind`` (default h100) at ``mfu`` and ``mbu`` (defaults ``DEFAULT_MFU``, ``DEFAULT_MBU``).
    SimUserError for an option another one makes ignored, an unknown kind, a factor outside (0, 1]
    or a bad file."""
    given = [f for f, v in (("--gpu-kind", gpu_kind), ("--mfu", mfu), ("--mbu", mbu)) if v is not None]
    if linear is not None:
        ignored = [*given, *(["--calibration"] if calibration is not None else [])]
        if ignored:
            raise SimUserError(
                f"--step-ms/--tokens-per-s replace the compute model, which {', '.join(ignored)} "
                "configure: drop one or the other"
            )
        return LinearCost(linear[0], linear[1])
    if calibration is not None:
        if given:
            raise SimUserError(
                f"--calibration replaces the roofline, which {', '.join(given)} configure: drop one or the other"
            )
        return load_calibration(calibration)
    kind = DEFAULT_GPU_KIND if gpu_kind is None else gpu_kind
    gpu = GPU_KINDS.get(kind)
    if gpu is None:
        raise SimUserError(f"unknown --gpu-kind {kind!r}; choose one of {', '.join(GPU_KINDS)}")
    factors = (DEFAULT_MFU if mfu is None else mfu, DEFAULT_MBU if mbu is None else mbu)
    for option, v in zip(("--mfu", "--mbu"), factors):
        if not 0.0 < v <= 1.0:
            raise SimUserError(f"{option} must be in (0, 1] (a share of the peak), got {v:g}")
    return RooflineCost(shape, gpu, factors[0], factors[1])


def describe_cost(cost: StepCost | None, gpu_quota_bytes: float = 0.0) -> dict[str, object]:
    """The report's record of a step cost: its kind, parameters and a line of text (None: the
    replay's default, a ``LinearCost`` of its options). The roofline's also has the model's weights
    and the GPU's memory, and a ``warning`` (else None) when the weights plus ``gpu_quota_bytes``
    (the GPU tier) exceed it: the roofline assumes one GPU holds them all."""
    if isinstance(cost, RooflineCost):
        gpu = cost.gpu
        text = f"roofline on {gpu.name} (MFU {cost.mfu:g}, MBU {cost.mbu:g})"
        warning = None
        if cost.weights_bytes + gpu_quota_bytes > gpu.hbm_bytes:
            warning = (
                f"the model's weights ({format_bytes(cost.weights_bytes)}) plus the GPU tier "
                f"({format_bytes(gpu_quota_bytes)}) exceed one {gpu.name}'s {format_bytes(gpu.hbm_bytes)}: "
                "the roofline assumes one GPU; tensor parallelism is not modelled"
            )
        return {
            "model": "roofline",
            "gpu_kind": gpu.name,
            "mfu": cost.mfu,
            "mbu": cost.mbu,
            "weights_bytes": cost.weights_bytes,
            "hbm_bytes": gpu.hbm_bytes,
            "warning": warning,
            "text": text,
        }
    if isinstance(cost, CalibrationCost):
        return {
            "model": "calibration",
            "path": cost.path,
            "coefficients": list(cost.coefficients),
            "text": f"calibrated by {os.path.basename(cost.path)}",
        }
    if isinstance(cost, LinearCost):
        text = f"{cost.step_ms:g} ms a step + {cost.tokens_per_s:g} tokens/s"
        return {"model": "linear", "step_ms": cost.step_ms, "tokens_per_s": cost.tokens_per_s, "text": text}
    return {"model": type(cost).__name__, "text": type(cost).__name__}
