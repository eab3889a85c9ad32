"""KV checksums (kvdisagg.connector.integrity): a pull's stream hashes the same on both sides,
whatever their layouts, and any change of a byte shows."""

from __future__ import annotations

import itertools
import random

import msgspec
import pytest
import torch
import xxhash

from kvdisagg.connector.integrity import (
    TRAILER_BYTES,
    Algorithm,
    Digester,
    digest_views,
    pack_trailer,
    unpack_trailer,
    wsum64,
)
from kvdisagg.connector.layout import copy_runs, layer_regions, stage_into, with_arena
from kvdisagg.connector.protocol.frames import Checksum, Done, Read, encode_frame
from kvdisagg.connector.protocol.versions import PROTOCOL_VERSION
from tests.support.transport_peer import kv_caches


def cuts(data: bytes, rng: random.Random) -> list[memoryview]:
    """``data`` cut at random places (empty pieces included)."""
    points = sorted(rng.randrange(len(data) + 1) for _ in range(6))
    bounds = [0, *points, len(data)]
    return [memoryview(data)[a:b] for a, b in itertools.pairwise(bounds)]


def test_digest_views_is_xxh3_of_the_stream_however_it_is_cut():
    rng = random.Random(1)
    data = rng.randbytes(100_003)
    want = xxhash.xxh3_64(data).digest()
    for _ in range(5):
        assert digest_views(cuts(data, rng)) == want
    assert digest_views([]) == digest_views([b"", memoryview(b"")]) == xxhash.xxh3_64().digest()
    assert len(want) == 8


def test_wsum64_depends_on_the_stream_alone_and_sees_any_change():
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (4096 + 5,), dtype=torch.uint8, generator=g)
    want = wsum64([data])
    assert len(want) == 16 and wsum64([]) == bytes(16)
    assert wsum64([data[:1024], data[1024:1024], data[1024:]]) == want
    assert wsum64([data[:13], data[13:4000], data[4000:]]) == want  # misaligned pieces
    flipped = data.clone()
    flipped[777] ^= 0x01
    assert wsum64([flipped]) != want
    swapped = data.clone()
    swapped[0:8], swapped[8:16] = data[8:16].clone(), data[0:8].clone()  # two words swapped
    assert wsum64([swapped]) != want
    top = data.clone()
    top[15] ^= 0x80  # the top bit of a word at an even position: caught by the plain sum
    assert wsum64([top]) != want


@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_both_sides_agree_across_layouts_and_the_arena(algorithm):
    """Prefill's scattered blocks (some staged in its arena) and decode's other blocks: once
    decode holds the same bytes, the two digests are equal; one changed byte differs."""
    src = layer_regions(kv_caches(3, num_blocks=16))
    src = with_arena(src, 4)
    stage_into(src, [5, 6], [16, 17])  # blocks 5, 6 now also in arena rows 16, 17
    dst_caches = kv_caches(None, num_blocks=16)
    dst = layer_regions(dst_caches)
    remote, local = [2, 3, 9, 16, 17, 11], [0, 1, 2, 7, 12, 13]
    runs = copy_runs(len(src), remote, local)
    for run in runs:  # what a transport does: the bytes of each run, into decode's blocks
        dst[run.layer].rows(run.dst, run.count).copy_(src[run.layer].rows(run.src, run.count))
    prefill, decode = Digester(src), Digester(dst)
    assert prefill.native is decode.native is Algorithm.XXH3_64
    sent = prefill.digest(runs, "src", algorithm)
    assert decode.digest(runs, "dst", algorithm) == sent
    stream = [src[r.layer].rows(r.src, r.count) for r in runs]  # the bytes, in CopyRun order
    if algorithm is Algorithm.XXH3_64:
        assert sent == digest_views(bytes(t.numpy()) for t in stream)
    else:  # gathered per layer (prefill's scattered blocks), the same stream
        assert sent == wsum64(stream)
    dst[1].pages[12].view(-1)[100] ^= 1  # one byte of a staged block's copy, layer 1
    assert decode.digest(runs, "dst", algorithm) != sent
    dst[1].pages[12].view(-1)[100] ^= 1
    first, second = dst[0].pages[0].clone(), dst[0].pages[1].clone()
    dst[0].pages[0].copy_(second)  # two blocks swapped: the same bytes in another order
    dst[0].pages[1].copy_(first)
    assert decode.digest(runs, "dst", algorithm) != sent


def test_digest_of_no_runs_and_of_blocks_outside_the_memory():
    d = Digester(layer_regions(kv_caches(1, num_blocks=4)))
    assert d.digest([], "src") == digest_views([])
    with pytest.raises(ValueError, match="not in this worker's KV memory"):
        d.digest(copy_runs(2, [3, 4], [0, 1]), "src")


def test_trailer_round_trip():
    digest = xxhash.xxh3_64(b"kv").digest()
    assert len(pack_trailer(digest)) == TRAILER_BYTES
    assert unpack_trailer(pack_trailer(digest)) == digest
    assert unpack_trailer(memoryview(pack_trailer(None))) is None
    with pytest.raises(ValueError, match="not a kvdisagg chunk trailer"):
        unpack_trailer(bytes(TRAILER_BYTES))


def test_checksum_frames_on_the_wire():
    assert PROTOCOL_VERSION >= 4  # checksums came with version 4
    decoder = msgspec.msgpack.Decoder(Read | Checksum | Done)
    read = Read(handoff_id="h", token="t", block_ids=[1], dst_block_ids=[2], checksum="xxh3_64")
    frame = encode_frame(read)
    assert decoder.decode(frame[4:]) == read
    assert Read(handoff_id="h", token="t", block_ids=[], dst_block_ids=[]).checksum == ""
    assert Done(handoff_id="h", token="t").checksum_ok
    with pytest.raises(msgspec.ValidationError):  # a digest is small: bounded on the wire
        decoder.decode(msgspec.msgpack.encode({"type": "Checksum", "algorithm": "x",
                                               "digest": b"0" * 65}))
