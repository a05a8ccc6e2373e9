"""The tiny model's recurrent layer kind (Mamba2-like) and hybrid models, stepped with explicit
per-sequence state (examples/tiny_engine/hybrid.py): chunked prefill and decode equal the dense
reference, snapshots hold exactly the state at their recorded position and resume to the same
generation, beams fork independently, and the state-size formulas match the arrays."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import numpy as np
import pytest
from conftest import tokens_of
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_cache_manager_v2 import TokenId, TokenIdExt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from tiny_engine.engine import PagedEngine
from tiny_engine.hybrid import (
    SequenceState,
    Snapshot,
    chunk_bounds,
    greedy_decode,
    prefill,
    resume,
    snapshot_error,
)
from tiny_engine.model import (
    LayerSpec,
    RecurrentShape,
    RecurrentState,
    TinyConfig,
    TinyModel,
    gated_delta_net_state_bytes,
    hybrid_layers,
    mamba1_state_bytes,
    mamba2_state_bytes,
    parallel_layers,
)
from tiny_engine.workload import WorkloadParams, make_adapter

TOL = 1e-12
#: a wrong state must show up far above rounding noise
DETECTED = 1e-6

MODELS = {
    "hybrid": TinyModel(TinyConfig(layers=hybrid_layers())),
    "parallel": TinyModel(TinyConfig(layers=parallel_layers(), seed=1)),
}


def max_err(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max()) if a.size else 0.0


# ---------------------------------------------------------------- the layer itself


@pytest.mark.parametrize("name", list(MODELS))
def test_recurrent_steps_equal_the_closed_form(name: str) -> None:
    """The recurrence stepped chunk by chunk through explicit states equals the quadratic closed form,
    outputs and final state, for every recurrent layer."""
    model = MODELS[name]
    x = model.embed(tokens_of(3, 29))
    for layer in model.cfg.recurrent_layers:
        y_ref, s_ref = model.dense_recurrent(layer, x)
        state = model.initial_state()
        outs = []
        for b, e in zip([0, 1, 8, 9, 20], [1, 8, 9, 20, 29]):
            before = RecurrentState(state.conv_state.copy(), state.ssm_state.copy())
            out, state_next = model.recurrent(layer, x[b:e], state)
            # the step leaves its input state alone (the caller decides where the new one goes)
            assert np.array_equal(before.conv_state, state.conv_state)
            assert np.array_equal(before.ssm_state, state.ssm_state)
            outs.append(out)
            state = state_next
        assert max_err(np.concatenate(outs), y_ref) <= TOL
        assert max_err(state.conv_state, s_ref.conv_state) <= TOL
        assert max_err(state.ssm_state, s_ref.ssm_state) <= TOL
        assert np.abs(s_ref.ssm_state).max() > 0.1  # the state carries something


def test_conv_state_is_the_last_inputs() -> None:
    """``conv_state`` holds the last ``conv_width - 1`` conv inputs, zero-padded before the first token."""
    model = MODELS["hybrid"]
    rs = model.cfg.recurrent
    x = model.embed(tokens_of(4, 2))
    xbc = model._rms(x, model.layers[0]["norm1"]) @ model.layers[0]["w_xbc"]
    _, state = model.recurrent(0, x, model.initial_state())
    assert state.conv_state.shape == rs.conv_state_shape
    assert np.array_equal(state.conv_state[: rs.conv_width - 3], np.zeros((rs.conv_width - 3, rs.conv_dim)))
    assert max_err(state.conv_state[-2:], xbc) <= TOL


def test_layer_kinds_keep_the_right_state() -> None:
    """Attention layers keep K/V, recurrent ones a state, parallel ones both; the state's shape is fixed."""
    hybrid, parallel = (SequenceState(MODELS[n]) for n in ("hybrid", "parallel"))
    assert (sorted(hybrid.keys), sorted(hybrid.states)) == ([3, 7], [0, 1, 2, 4, 5, 6])
    assert (sorted(parallel.keys), sorted(parallel.states)) == ([0, 1, 3], [0, 1, 2, 3])
    before = {i: (s.conv_state.shape, s.ssm_state.shape) for i, s in parallel.states.items()}
    parallel.step(tokens_of(2, 9))
    assert {i: (s.conv_state.shape, s.ssm_state.shape) for i, s in parallel.states.items()} == before
    assert all(k.shape[0] == 9 for k in parallel.keys.values())


def test_attention_only_model_steps_equal_dense() -> None:
    """The default (attention-only) model through the same runner: no recurrent state at all."""
    model = TinyModel(TinyConfig())
    assert model.cfg.recurrent_layers == []
    toks = tokens_of(5, 30)
    seq = SequenceState(model)
    logits, snaps = prefill(seq, toks, [7, 3, 11], snapshot_interval=8)
    assert seq.states == {}
    assert all(s.states == {} for s in snaps)
    assert max_err(logits, model.dense_logits(toks)) <= TOL


# ---------------------------------------------------------------- chunked prefill and decode


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(list(MODELS)),
    seed=st.integers(0, 10_000),
    prompt_len=st.integers(1, 40),
    chunks=st.lists(st.integers(1, 17), min_size=1, max_size=6),
    decode_len=st.integers(0, 8),
)
def test_chunked_prefill_and_decode_equal_dense(
    name: str, seed: int, prompt_len: int, chunks: list[int], decode_len: int
) -> None:
    model = MODELS[name]
    prompt = tokens_of(seed, prompt_len)
    seq = SequenceState(model)
    logits, _ = prefill(seq, prompt, chunks)
    out, dec_logits, _ = greedy_decode(seq, logits[-1], decode_len)
    assert seq.num_tokens == prompt_len + decode_len
    ref = model.dense_logits(prompt + out)
    # the last token's logits are the decode steps' only output beyond the sequence
    assert max_err(logits, ref[:prompt_len]) <= TOL
    assert max_err(dec_logits, ref[prompt_len:]) <= TOL


# ---------------------------------------------------------------- snapshots


def run_with_snapshots(
    model: TinyModel, prompt: Sequence[TokenIdExt], chunks: list[int], decode_len: int, interval: int
) -> tuple[SequenceState, list[TokenIdExt], list[Snapshot]]:
    seq = SequenceState(model)
    logits, snaps = prefill(seq, prompt, chunks, snapshot_interval=interval)
    out, _, more = greedy_decode(seq, logits[-1], decode_len, snapshot_interval=interval)
    return seq, list(prompt) + out, snaps + more


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(list(MODELS)),
    seed=st.integers(0, 10_000),
    prompt_len=st.integers(1, 36),
    chunks=st.lists(st.integers(1, 13), min_size=1, max_size=5),
    decode_len=st.integers(0, 9),
    interval=st.sampled_from([4, 8, 12]),
    resume_chunks=st.lists(st.integers(1, 13), min_size=1, max_size=3),
)
def test_every_snapshot_holds_the_state_at_its_position(
    name: str,
    seed: int,
    prompt_len: int,
    chunks: list[int],
    decode_len: int,
    interval: int,
    resume_chunks: list[int],
) -> None:
    """For random chunkings and decode lengths: snapshots exist at every multiple of the interval and at
    the prompt end, each equals the dense state at its recorded position, and resuming from it (prefill
    the remaining tokens) reproduces the dense logits."""
    model = MODELS[name]
    prompt = tokens_of(seed, prompt_len)
    seq, all_tokens, snaps = run_with_snapshots(model, prompt, chunks, decode_len, interval)
    expected = sorted(set(range(interval, len(all_tokens) + 1, interval)) | {prompt_len})
    assert [s.position for s in snaps] == expected
    ref = model.dense_logits(all_tokens)
    for snap in snaps:
        assert snapshot_error(model, all_tokens, snap) <= TOL
        if snap.position == len(all_tokens):
            continue
        resumed = resume(seq, snap)
        logits, _ = prefill(resumed, all_tokens[snap.position :], resume_chunks)
        assert max_err(logits, ref[snap.position :]) <= TOL


def check_mislabelled_snapshots(model: TinyModel, prompt: list[TokenIdExt], chunks: list[int], interval: int) -> int:
    """Run ``prompt`` in chunks not cut at snapshot boundaries; at every chunk end past a boundary,
    record the state under the boundary position before it (the bug) and check that both the state
    check and the resumed generation catch it. Returns how many were mislabelled."""
    ref = model.dense_logits(prompt)
    seq = SequenceState(model)
    mislabelled = 0
    for stop in chunk_bounds(0, len(prompt), chunks):
        seq.step(prompt[seq.num_tokens : stop])
        snap = seq.snapshot()
        assert snapshot_error(model, prompt, snap) <= TOL  # at its true position it is right
        boundary = stop // interval * interval
        if boundary in (0, stop):
            continue
        wrong = Snapshot(boundary, snap.states)
        mislabelled += 1
        assert snapshot_error(model, prompt, wrong) > DETECTED
        logits, _ = prefill(resume(seq, wrong), prompt[boundary:], [5])
        assert max_err(logits, ref[boundary:]) > DETECTED
    return mislabelled


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(list(MODELS)),
    seed=st.integers(0, 10_000),
    prompt_len=st.integers(10, 36),
    chunks=st.lists(st.integers(1, 13), min_size=1, max_size=5),
    interval=st.sampled_from([4, 8]),
)
def test_chunk_end_state_recorded_at_a_boundary_is_detected(
    name: str, seed: int, prompt_len: int, chunks: list[int], interval: int
) -> None:
    """The bug class (a chunk-end state cached as a block-boundary state) is caught for every chunking."""
    check_mislabelled_snapshots(MODELS[name], tokens_of(seed, prompt_len), chunks, interval)


@pytest.mark.parametrize("name", list(MODELS))
def test_chunk_end_state_recorded_at_a_boundary_fixed_case(name: str) -> None:
    # chunk ends 5, 10, ..., 30 with interval 8: all but the first fall past a boundary
    assert check_mislabelled_snapshots(MODELS[name], tokens_of(14, 30), [5], 8) == 5


@pytest.mark.parametrize("name", list(MODELS))
def test_prompt_end_snapshot_serves_a_follow_up_turn(name: str) -> None:
    """A second turn (prompt + answer + new message) resumes from the first prompt's end snapshot; the
    snapshot is copied, never written, so a third request resumes from it too."""
    model = MODELS[name]
    prompt = tokens_of(6, 21)
    seq, first_turn, snaps = run_with_snapshots(model, prompt, [6], 5, interval=8)
    prompt_end = next(s for s in snaps if s.position == len(prompt))
    kept = {i: (s.conv_state.copy(), s.ssm_state.copy()) for i, s in prompt_end.states.items()}
    for follow_seed in (7, 8):
        second = first_turn + tokens_of(follow_seed, 9)
        resumed = resume(seq, prompt_end)
        logits, _ = prefill(resumed, second[len(prompt) :], [4, 7])
        assert max_err(logits, model.dense_logits(second)[len(prompt) :]) <= TOL
    for i, s in prompt_end.states.items():
        assert np.array_equal(s.conv_state, kept[i][0]) and np.array_equal(s.ssm_state, kept[i][1])


def test_resume_from_the_wrong_kv_is_detected() -> None:
    """Resuming needs the K/V of the same tokens: a K/V source of other tokens gives other logits (the
    attention layers matter in the hybrid, the check is not vacuous)."""
    model = MODELS["hybrid"]
    toks = tokens_of(9, 24)
    other = tokens_of(10, 24)
    seq, _, snaps = run_with_snapshots(model, toks, [5], 0, interval=8)
    foreign = SequenceState(model)
    foreign.step(other)
    snap = next(s for s in snaps if s.position == 16)
    ref = model.dense_logits(toks)[16:]
    assert max_err(prefill(resume(seq, snap), toks[16:], [8])[0], ref) <= TOL
    assert max_err(prefill(resume(foreign, snap), toks[16:], [8])[0], ref) > DETECTED


# ---------------------------------------------------------------- beams


@pytest.mark.parametrize("name", list(MODELS))
def test_beam_fork_continues_independently(name: str) -> None:
    """Forking copies the state: two beams continued with different tokens, steps interleaved, each
    equal the dense reference of its own tokens."""
    model = MODELS[name]
    prompt = tokens_of(11, 19)
    seq = SequenceState(model)
    prefill(seq, prompt, [7])
    beams = [seq, seq.fork()]
    tokens = [list(prompt), list(prompt)]
    logits: list[list[np.ndarray]] = [[], []]
    for step in range(6):
        for b in (0, 1):
            token = TokenId((3 + 40 * b + 7 * step) % model.cfg.vocab_size)
            tokens[b].append(token)
            logits[b].append(beams[b].step([token])[0])
    for b in (0, 1):
        ref = model.dense_logits(tokens[b])[len(prompt) :]
        assert max_err(np.array(logits[b]), ref) <= TOL
    assert max_err(np.array(logits[0]), np.array(logits[1])) > DETECTED


def test_beams_sharing_one_state_are_detected() -> None:
    """The bug a fork must avoid: two beams writing one recurrent state slot."""
    model = MODELS["hybrid"]
    prompt = tokens_of(12, 15)
    seq = SequenceState(model)
    prefill(seq, prompt, [15])
    aliased = seq.fork()
    aliased.states = seq.states  # K/V copied, recurrent state shared
    seq.step([TokenId(1)])
    out = aliased.step([TokenId(2)])
    assert max_err(out, model.dense_logits(prompt + [TokenId(2)])[-1:]) > DETECTED


# ---------------------------------------------------------------- state sizes and validation


@pytest.mark.parametrize(
    "shape",
    [RecurrentShape(), RecurrentShape(num_heads=6, head_dim=4, state_dim=5, num_groups=3, conv_width=2)],
)
def test_state_bytes_match_the_arrays(shape: RecurrentShape) -> None:
    model = TinyModel(TinyConfig(layers=hybrid_layers(1), recurrent=shape, d_model=24))
    state = model.initial_state()
    sizes = model.cfg.recurrent_state_bytes()
    assert sizes == {"conv_state": state.conv_state.nbytes, "ssm_state": state.ssm_state.nbytes}
    seq = SequenceState(model)
    seq.step(tokens_of(13, 5))
    for s in seq.states.values():
        assert (s.conv_state.nbytes, s.ssm_state.nbytes) == (sizes["conv_state"], sizes["ssm_state"])
    # mixed dtypes: the conv state in the model dtype, the ssm state in float32
    mixed = shape.state_bytes(conv_dtype_bytes=2, ssm_dtype_bytes=4)
    assert mixed == {"conv_state": sizes["conv_state"] // 4, "ssm_state": sizes["ssm_state"] // 2}


def test_state_formulas_of_the_other_families() -> None:
    """Mamba1's state equals Mamba2's with one channel per head, but its convolution sees x only (no B,
    C); gated delta-net's convolution sees q, k and v, its state is one key x value matrix per head."""
    m1 = mamba1_state_bytes(64, 16, 4, conv_dtype_bytes=2, ssm_dtype_bytes=4)
    m2 = mamba2_state_bytes(64, 1, 16, 1, 4, conv_dtype_bytes=2, ssm_dtype_bytes=4)
    assert m1["ssm_state"] == m2["ssm_state"] == 64 * 16 * 4
    assert m1["conv_state"] == 3 * 64 * 2
    assert m2["conv_state"] == 3 * (64 + 2 * 16) * 2
    gdn = gated_delta_net_state_bytes(2, 4, 8, 16, 4, conv_dtype_bytes=2, ssm_dtype_bytes=4)
    assert gdn == {"conv_state": 3 * (2 * 2 * 8 + 4 * 16) * 2, "ssm_state": 4 * 8 * 16 * 4}


def test_validation() -> None:
    with pytest.raises(ValueError, match="layer kind"):
        LayerSpec(kind="mamba")
    with pytest.raises(ValueError, match="no attention window"):
        LayerSpec(window=8, kind="recurrent")
    with pytest.raises(ValueError, match="num_groups"):
        RecurrentShape(num_heads=4, num_groups=3)
    with pytest.raises(ValueError, match="conv_width"):
        RecurrentShape(conv_width=1)
    model = MODELS["hybrid"]
    adapter = make_adapter(TinyConfig(), WorkloadParams(full_slots=4, swa_slots=4))
    try:
        with pytest.raises(ValueError, match=r"has no layer 7: build it from model\.cfg\.layer_configs"):
            PagedEngine(model, adapter)
    finally:
        adapter.shutdown()
    bad = RecurrentState(np.zeros((2, 3)), model.initial_state().ssm_state)
    with pytest.raises(ValueError, match="state shapes"):
        model.recurrent(0, model.embed(tokens_of(1, 2)), bad)
    seq = SequenceState(model)
    with pytest.raises(ValueError, match="at least one token"):
        seq.step([])
    with pytest.raises(ValueError, match="chunk sizes"):
        chunk_bounds(0, 10, [4, 0])
    with pytest.raises(ValueError, match="snapshot_interval"):
        chunk_bounds(0, 10, [4], snapshot_interval=0)
    with pytest.raises(ValueError, match="K/V source"):
        resume(seq, Snapshot(3, seq.snapshot().states))
    assert chunk_bounds(5, 30, [4, 10], snapshot_interval=8) == [8, 16, 24, 30]
    assert chunk_bounds(0, 11, [3, 2]) == [3, 5, 7, 9, 11]
