"""Block keys hashed in runs (blockhash's native chain, hashlib's fallback) equal the per-block
definition, for every way keys are computed: matching, probe -> create, and publishing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array
from typing import cast

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
    validate_tokens,
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


def _same_block_reference(block: object, tokens: object, beg: int, per_block: int) -> bool | None:
    """What ``blockhash.same_block`` must answer: None where it cannot tell (a block that is not a
    tuple, tokens of another type, a query token in the block that is not exactly a valid id or
    non-empty bytes before the first difference); else whether the block is full and equal."""
    if isinstance(block, array) and block.typecode == "I":  # a block committed from an array
        if len(block) != per_block:
            return False
        if isinstance(tokens, array):
            return None if tokens.typecode != "I" else tuple(tokens[beg : beg + per_block]) == tuple(block)
        if type(tokens) not in (list, tuple):
            return None
        seq_ids = list(cast("list[object] | tuple[object, ...]", tokens))
        if beg + per_block > len(seq_ids):
            return False
        for have, want in zip(seq_ids[beg : beg + per_block], block):
            if type(have) is bytes and have:
                return False
            if type(have) is not int or not 0 <= have < 1 << 32:
                return None
            if have != want:
                return False
        return True
    if type(block) is not tuple:
        return None
    if isinstance(tokens, array):
        if tokens.typecode != "I":
            return None
        return len(block) == per_block and tuple(tokens[beg : beg + per_block]) == block
    if type(tokens) not in (list, tuple):
        return None
    if len(block) != per_block:
        return False
    seq = cast("list[object]", list(cast("list[object] | tuple[object, ...]", tokens)))
    if beg + per_block > len(seq):
        return False
    for have, want in zip(seq[beg : beg + per_block], block):
        if have is want:
            continue
        valid = (type(have) is int and 0 <= have < 1 << 32) or (type(have) is bytes and len(have) > 0)
        if not valid:
            return None
        if type(have) is not type(want) or have != want:
            return False
    return True


@pytest.mark.parametrize("kind", ["list", "tuple", "array"])
def test_same_block_compares_in_place_like_a_slice(kind: str) -> None:
    """same_block(block, tokens, beg, T) agrees with comparing the slice, on equal, different,
    shorter, out-of-range and bad-token cases (None where hashing must decide)."""
    t = 4
    base: list[object] = [5, 70_000, 2**32 - 1, 0, 9, 9, 9, 9, 1, 2]
    variants: list[list[object]] = [base]
    if kind != "array":
        for i, bad in [(1, True), (2, 2**32), (0, -1), (3, 1.0), (1, b""), (2, None)]:
            v = list(base)
            v[i] = bad
            variants.append(v)
        v = list(base)
        v[1] = b"digest"
        variants.append(v)
    blocks: list[object] = [
        (5, 70_000, 2**32 - 1, 0),
        (5, 70_000, 2**32 - 1, 1),
        (4, 70_000, 2**32 - 1, 0),
        (5, 70_000, 2**32 - 1),  # a partial block holding the first tokens
        (9, 9, 9, 9),
        (9, 9, 1, 2),
        (5, b"digest", 2**32 - 1, 0),
        [5, 70_000, 2**32 - 1, 0],  # neither a tuple nor an array
        array("I", [5, 70_000, 2**32 - 1, 0]),  # a block committed from an array
        array("I", [9, 9, 1, 2]),
        array("I", [5, 70_000, 2**32 - 1]),
        array("L", [5, 70_000, 2**32 - 1, 0]),
    ]
    for tokens_list in variants:
        tokens: object = tokens_list
        if kind == "tuple":
            tokens = tuple(tokens_list)
        elif kind == "array":
            tokens = array("I", cast("list[int]", tokens_list))
        for block in blocks:
            for beg in (0, 4, 6, 7, 20):
                want = _same_block_reference(block, tokens, beg, t)
                assert blockhash.same_block(block, tokens, beg, t) is want, (tokens, block, beg)
    # the very same objects compare in one pass; a differing object then decides by value
    ids = [70_000 + i for i in range(2 * t)]
    block_of = tuple(ids[t:])
    assert blockhash.same_block(block_of, ids, t, t) is True
    equal, other, bad = list(ids), list(ids), list(ids)
    equal[-1], other[-1], bad[-1] = int(str(ids[-1])), ids[-1] + 1, True
    assert equal[-1] is not ids[-1]
    assert [blockhash.same_block(block_of, x, t, t) for x in (equal, other, bad)] == [True, False, None]
    # big ints from other objects compare by value; other sequence types: None
    assert blockhash.same_block((2**31 + 5,), [int("2147483653")], 0, 1) is True
    assert blockhash.same_block((1, 2), array("L", [1, 2]), 0, 2) is None
    assert blockhash.same_block((1, 2), range(1, 3), 0, 2) is None
    assert blockhash.same_block(array("I", [1, 2]), range(1, 3), 0, 2) is None
    with pytest.raises(ValueError, match="negative"):
        blockhash.same_block((1,), [1], -1, 1)
    with pytest.raises(ValueError, match="positive"):
        blockhash.same_block((1,), [1], 0, 0)


def test_same_block_with_a_start_near_the_largest_index_is_false_not_a_crash() -> None:
    """``beg + per_block`` overflowed for a ``beg`` near ``sys.maxsize`` (issue 47 item 26): the bounds
    check passed and the comparison read far outside the tokens (a segmentation fault). In a child
    process, so that a crash is a failure here, not the end of the test run."""
    code = """if True:
        import sys
        from array import array
        import blockhash
        blocks = [(1, 2), array("I", [1, 2])]
        queries = [[1, 2], (1, 2), array("I", [1, 2])]
        print([blockhash.same_block(b, q, beg, n) for b in blocks for q in queries
               for beg in (sys.maxsize, sys.maxsize - 1) for n in (2, sys.maxsize)])
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([False] * 24)


@pytest.mark.parametrize("num_children", [1, 3, 12])  # compared token by token / hashed at a wide branch
@pytest.mark.parametrize("as_array", [False, True])
def test_match_by_tokens_records_the_keys_hashing_would(num_children: int, as_array: bool) -> None:
    """A match follows a few children by their tokens instead of hashing: the keys it records,
    the blocks it matches and what a create then reuses equal the hashed ones; a partial sibling
    holding the start of a block is no match for the full block."""
    t = 4
    m = KVCacheManager(make_config(kv_layers(1), tokens_per_block=t))  # type: ignore[arg-type]
    shared = list(range(1000, 1000 + 3 * t))
    prompts = [shared + [50_000 + c * 100 + i for i in range(2 * t)] for c in range(num_children)]
    prompts.append(shared + [50_000, 50_001])  # a partial tail: the start of the first child's block
    for prompt in prompts:
        kv = m.create_kv_cache(input_tokens=[])
        assert kv.resume() and kv.resize(len(prompt))
        kv.commit(prompt)
        kv.close()
    root = m._tree.root(ReuseScope(), False)
    assert root is not None
    for c in (0, num_children - 1):
        query = prompts[c] + [7, 7, 7]  # a miss after the cached blocks
        want = BlockHasher(query, t, "q").chain(scope_key(ReuseScope()))
        hasher = BlockHasher(array("I", query) if as_array else query, t, "q")
        nodes, part, part_len = m._tree.match(root, hasher, True)
        assert [n.key for n in nodes] == want[:5]
        assert hasher.keys == want[: len(hasher.keys)] and len(hasher.keys) >= 5
        assert part is None and part_len == 0
        assert m.probe_reuse(None, query) == 5 * t
        kv = m.create_kv_cache(input_tokens=query)
        assert kv.num_committed_tokens == 5 * t
        kv.close()
    # the partial sibling matches only as a partial block
    assert m.probe_reuse(None, [*shared, 50_000, 50_001, 3]) == 3 * t + 2
    m.shutdown()


@pytest.mark.parametrize("bad", [True, 1.0, -1])
def test_a_bad_token_in_a_cached_block_still_raises(bad: object) -> None:
    """A token equal in value to the cached one but not a valid id (a bool, a float, ...) is
    refused as before, though the match compares tokens instead of hashing them."""
    t = 4
    m = KVCacheManager(make_config(kv_layers(1), tokens_per_block=t))  # type: ignore[arg-type]
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    kv = m.create_kv_cache(input_tokens=[])
    assert kv.resume() and kv.resize(len(prompt))
    kv.commit(prompt)
    kv.close()
    query: list[object] = list(prompt)
    if bad == -1:
        query[4] = -1  # in the second (cached) block
    else:
        query[0] = bad  # equal in value to the cached 1
    error = ValueError if bad == -1 else TypeError
    with pytest.raises(error, match="input_tokens"):
        m.probe_reuse(None, query)  # type: ignore[arg-type]
    with pytest.raises(error, match="input_tokens"):
        m.create_kv_cache(input_tokens=query)  # type: ignore[arg-type]
    assert m.num_open_caches == 0
    m.shutdown()


def test_all_ids_accepts_exact_valid_ids_only() -> None:
    """all_ids is validate_tokens' native shortcut: True only where every token is an exact int in
    [0, 2**32) (the loop then never runs); everything else goes to the token-by-token check."""
    assert blockhash.all_ids([]) and blockhash.all_ids(()) and blockhash.all_ids([0, 2**32 - 1, 7])
    assert blockhash.all_ids((5, 2**31))
    for bad in (-1, 2**32, 2**70, True, 1.0, b"digest", None):
        assert not blockhash.all_ids([1, bad, 2])
        assert not blockhash.all_ids((bad,))
    assert not blockhash.all_ids(array("I", [1, 2]))  # arrays are checked by their typecode
    assert not blockhash.all_ids(range(3))
    # the slow path still names the bad token (and accepts digests)
    validate_tokens([1, b"digest", 3])
    with pytest.raises(ValueError, match="toks: token id 4294967296 is outside"):
        validate_tokens([1, 2**32], "toks")
    with pytest.raises(TypeError, match="toks: tokens must be int or bytes"):
        validate_tokens((1, True), "toks")
