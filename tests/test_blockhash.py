"""Block keys hashed in runs (blockhash's native chain, hashlib's fallback) equal the per-block
definition, for every way keys are computed: matching, probe -> create, and publishing."""

from __future__ import annotations

import hashlib
import os
from array import array

import pytest
from conftest import kv_layers, make_config

import blockhash
from kv_cache_manager_v2 import KVCacheManager, ReuseScope
from kv_cache_manager_v2._reuse._keys import (
    NATIVE_CHAIN,
    BlockHasher,
    block_key,
    chain_keys,
    chain_keys_hashlib,
    chain_token_keys,
    scope_key,
)


def _reference(parent: bytes, data: bytes, block_bytes: int) -> list[bytes]:
    out = []
    for beg in range(0, len(data), block_bytes):
        parent = hashlib.sha256(parent + data[beg : beg + block_bytes]).digest()
        out.append(parent)
    return out


def test_native_chain_is_available_here() -> None:
    # CI machines have the libcrypto hashlib uses; a silent fallback would hide a build problem
    assert blockhash.available and NATIVE_CHAIN


@pytest.mark.parametrize("size", [0, 1, 127, 128, 129, 1000, 128 * 49, 5000])
@pytest.mark.parametrize("block_bytes", [4, 128, 700, 4096])
def test_chain_equals_sha256_of_parent_and_block(size: int, block_bytes: int) -> None:
    parent = hashlib.sha256(b"root").digest()
    data = os.urandom(size)
    want = _reference(parent, data, block_bytes)
    assert blockhash.chain(parent, data, block_bytes) == want
    assert blockhash.chain(parent, memoryview(bytearray(data)), block_bytes) == want
    assert chain_keys_hashlib(parent, data, block_bytes) == want
    assert chain_keys(parent, data, block_bytes) == want


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 100, 300])
@pytest.mark.parametrize("block_tokens", [1, 32, 300])
def test_chain_tokens_encodes_ids_as_uint32(n: int, block_tokens: int) -> None:
    parent = hashlib.sha256(b"root").digest()
    tokens = [(i * 2_654_435_761) % (1 << 32) for i in range(n)]
    want = _reference(parent, array("I", tokens).tobytes(), 4 * block_tokens)
    assert blockhash.chain_tokens(parent, tokens, block_tokens) == want
    assert blockhash.chain_tokens(parent, tuple(tokens), block_tokens) == want
    assert chain_token_keys(parent, list(tokens), block_tokens) == want


def test_chain_tokens_with_digests_or_bad_ids() -> None:
    parent = bytes(32)
    assert blockhash.chain_tokens(parent, [1, b"digest", 3], 2) is None  # encoded another way
    assert chain_token_keys(parent, [1, b"digest", 3], 2) is None
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match="token 1 is outside"):
            blockhash.chain_tokens(parent, [1, bad], 2)
    with pytest.raises(TypeError, match="list or a tuple"):
        blockhash.chain_tokens(parent, array("I", [1]), 1)  # type: ignore[arg-type]


def test_chain_rejects_bad_arguments() -> None:
    parent = bytes(32)
    with pytest.raises(ValueError, match="32-byte"):
        blockhash.chain(b"short", b"x", 4)
    with pytest.raises(ValueError, match="positive"):
        blockhash.chain(parent, b"x", 0)
    with pytest.raises(TypeError):
        blockhash.chain(parent, "text", 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("as_array", [False, True])
def test_hasher_keys_equal_block_keys(as_array: bool) -> None:
    t = 8
    tokens = [(i * 7919) % 50_000 for i in range(8 * 8 * 3 + 5)]  # three chunks and a partial block
    root = scope_key(ReuseScope())
    want, parent = [], root
    for o in range(0, len(tokens), t):
        parent = block_key(parent, tokens[o : o + t])
        want.append(parent)
    hasher = BlockHasher(array("I", tokens) if as_array else tokens, t, "tokens")
    assert hasher.chain(root) == want
    # a match stops early: keys are computed a chunk at a time, never for the partial block
    hasher = BlockHasher(tokens, t, "tokens")
    parent = root
    for o in range(3):
        parent = hasher.key(parent, o)
    assert hasher.keys == want[:8]


@pytest.mark.parametrize("kind", ["list", "tuple", "digest_in_second_chunk", "numpy_ints"])
def test_hasher_native_chunks_and_python_fallback_agree(kind: str) -> None:
    """List and tuple tokens are checked, encoded and hashed natively a chunk at a time; a chunk
    holding anything but exact ints switches to the Python encoding. Keys equal block_key's either way."""
    t = 4
    tokens: list[object] = [(i * 7919) % 70_000 for i in range(8 * t * 3 + 2)]  # three chunks, a partial block
    if kind == "digest_in_second_chunk":
        tokens[8 * t + 5] = b"\x07" * 32
    seq: object = tuple(tokens) if kind == "tuple" else tokens
    if kind == "numpy_ints":
        np = pytest.importorskip("numpy")
        seq = list(np.array(tokens, dtype=np.int64))  # numpy integers are not token ids
        with pytest.raises(TypeError, match="tokens must be int or bytes"):
            BlockHasher(seq, t, "tokens").chain(scope_key(ReuseScope()))  # type: ignore[arg-type]
        return
    root = scope_key(ReuseScope())
    want, parent = [], root
    for o in range(0, len(tokens), t):
        parent = block_key(parent, tokens[o : o + t])  # type: ignore[arg-type]
        want.append(parent)
    assert BlockHasher(seq, t, "tokens").chain(root) == want  # type: ignore[arg-type]
    hasher = BlockHasher(seq, t, "tokens")  # type: ignore[arg-type]
    parent = root
    for o in range(10):  # into the second chunk, as a match that goes on
        parent = hasher.key(parent, o)
    # a chunk of ids at once (the first 16 blocks); a chunk holding a digest a block at a time
    assert hasher.keys == want[: 10 if kind == "digest_in_second_chunk" else 16]
    hasher.validate_rest()


@pytest.mark.parametrize("where", [3, 8 * 4 + 1, 8 * 4 * 3 + 1])  # first chunk, second chunk, partial block
@pytest.mark.parametrize("bad", [True, -1, 2**32, None])
def test_hasher_names_a_bad_token_wherever_it_is(where: int, bad: object) -> None:
    """A bad token raises the same error (TypeError / ValueError naming the argument) whether its
    chunk is hashed natively or in Python, or it sits in the partial block only checked at the end."""
    t = 4
    tokens: list[object] = list(range(1000, 1000 + 8 * t * 3 + 2))
    tokens[where] = bad
    error = TypeError if bad is None or bad is True else ValueError
    with pytest.raises(error, match="input_tokens"):
        BlockHasher(tokens, t, "input_tokens").chain(scope_key(ReuseScope()))  # type: ignore[arg-type]
    hasher = BlockHasher(tokens, t, "input_tokens")  # type: ignore[arg-type]
    with pytest.raises(error, match="input_tokens"):
        parent = scope_key(ReuseScope())
        for o in range(len(tokens) // t):
            parent = hasher.key(parent, o)
        hasher.validate_rest()


def test_probe_of_a_partial_block_then_longer_create() -> None:
    """probe_reuse's keys are kept for create_kv_cache; a block that was partial in the probed
    tokens is full in the created ones and must get its own key."""
    m = KVCacheManager(make_config(kv_layers(1), tokens_per_block=8, enable_partial_reuse=False))  # type: ignore[arg-type]
    prompt = list(range(100, 164))
    kv = m.create_kv_cache(input_tokens=prompt)
    assert kv.resume() and kv.resize(len(prompt))
    kv.commit(prompt)
    kv.close()
    assert m.probe_reuse(None, prompt[:37]) == 32
    other = m.create_kv_cache(input_tokens=prompt[:60])
    assert other.num_committed_tokens == 56
    other.close()
    assert m.probe_reuse(None, prompt[:37]) == 32
    wrong = m.create_kv_cache(input_tokens=prompt[:37] + [1, 2, 3, 4])
    assert wrong.num_committed_tokens == 32
    wrong.close()
    m.shutdown()


def test_published_keys_match_the_hasher() -> None:
    """A prefill commit hashes its blocks in one run; the tree's keys equal block_key's."""
    t = 8
    m = KVCacheManager(make_config(kv_layers(1), tokens_per_block=t))  # type: ignore[arg-type]
    prompt = list(range(1000, 1000 + 8 * t + 3))
    kv = m.create_kv_cache(input_tokens=[])
    assert kv.resume() and kv.resize(len(prompt))
    kv.commit(prompt[:5])
    kv.commit(prompt[5:])  # completes 8 blocks at once, the first started by the previous commit
    kv.close()
    keys = BlockHasher(prompt, t, "p").chain(scope_key(ReuseScope()))
    node = m._tree.root(ReuseScope(), False)
    assert node is not None
    for o in range(8):
        node = node.child(keys[o])
        assert node is not None and node.tokens == tuple(prompt[o * t : (o + 1) * t])
    m.shutdown()
