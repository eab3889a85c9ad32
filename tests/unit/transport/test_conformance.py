"""Every transport, one contract: prefill in a peer process (tests.support.transport_peer),
decode here, the same seeded KV on both ends, all on loopback.

tcp, nccl (gloo on CPU), mooncake (its TCP protocol) and lmcache (a real LMCache server).
Instances sharded differently (another TP or PP on each side): one peer process per prefill
rank, one transport here per decode rank, each decode rank pulling its Parts (sharding.py).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from kvdisagg.connector.config import ConnectorConfig
from kvdisagg.connector.sharding import Shape, plan
from kvdisagg.errors import ChecksumMismatch, IncompatiblePeerError, TransportError
from kvdisagg.local.servers import LMCacheServer, free_port
from kvdisagg.transport import Fetch, PullTiming
from tests.support.transport_peer import (
    BLOCK_SIZE,
    KV_LAYOUT,
    PeerProcess,
    geometry,
    kv_caches,
    model_kv,
    open_transport,
    shard_caches,
)

TRANSPORTS = ["tcp", "nccl", "mooncake", "lmcache"]
CORRUPTING = {"tcp": "Tcp", "nccl": "Nccl", "mooncake": "Mooncake", "lmcache": "LMCache"}
PULL = {"tcp", "nccl", "mooncake"}
TIMEOUT_S = 3.0
SEED = 7


@pytest.fixture(scope="module")
def lmcache_server():
    with LMCacheServer() as server:
        yield server


def extra_config(name: str, request) -> dict:
    extra = {"transfer_timeout_seconds": TIMEOUT_S, "side_channel_host": "127.0.0.1"}
    if name == "lmcache":
        extra |= {"lmcache_url": request.getfixturevalue("lmcache_server").url,
                  "lmcache_chunk_tokens": 2 * BLOCK_SIZE}
    if name == "mooncake":
        extra |= {"mooncake_protocol": "tcp"}
    return extra


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    """(name, extra config, peer, decode transport, decode KV)."""
    name = request.param
    extra = extra_config(name, request)
    peer = PeerProcess(name, extra, seed=SEED)
    config = msgspec.convert({**extra, "transport": name}, ConnectorConfig)
    dst = kv_caches(None)
    decode, _ = open_transport(config, dst, is_producer=False)
    yield name, extra, peer, decode, dst
    decode.close()
    peer.close()


def prompt_for(num_blocks: int) -> list[int]:
    """A random prompt whose last block is partial (as after a real prefill)."""
    return torch.randint(0, 30000, ((num_blocks - 1) * BLOCK_SIZE + 5,)).tolist()


def fetch_of(peer: PeerProcess, handoff_id: str, token: str, remote: list[int], local: list[int],
             prompt: list[int], first_block: int = 0) -> Fetch:
    return Fetch(handoff_id=handoff_id, token=token, host="127.0.0.1", port=peer.port,
                 kv_layout=KV_LAYOUT, remote_block_ids=tuple(remote[first_block:]),
                 local_block_ids=tuple(local), prompt_token_ids=tuple(prompt),
                 first_block=first_block)


def assert_moved(dst, remote: list[int], local: list[int]) -> None:
    src = kv_caches(SEED)
    for layer in src:
        assert torch.equal(dst[layer][local], src[layer][remote]), layer


def test_bytes_arrive_intact_and_the_handoff_is_released(pair):
    name, _, peer, decode, dst = pair
    remote, local, prompt = [2, 3, 4, 9], [7, 8, 0, 1], prompt_for(4)
    token = peer.offer("r1", remote, prompt)
    timing = PullTiming(time.time_ns())
    nbytes = decode.fetch(fetch_of(peer, "r1", token, remote, local, prompt), TIMEOUT_S, timing)
    if name in PULL:  # the handoff's phases, in order, on a fresh connection
        phases = timing.phases()
        assert [p for p, _, _ in phases] == ["connect", "read", "transfer", "done"]
        assert all(start <= end for _, start, end in phases) and not timing.reused
        assert phases[0][1] == timing.start_ns
    page = dst["layer.0"][0].numel() * 4
    assert nbytes == 4 * page * len(dst)
    assert_moved(dst, remote, local)
    untouched = [b for b in range(32) if b not in local]
    assert all(torch.count_nonzero(t[untouched]) == 0 for t in dst.values())
    assert "r1" in peer.released({"r1"})


def test_an_early_read_waits_for_its_offer_and_gets_its_blocks_by_position(pair):
    """The proxy sent decode's leg with prefill's: decode's Read names the handoff and block
    positions before prefill computed it, waits (Wait frames) while prefill expects it, then
    gets the blocks of the offer; a forgotten one is refused with prefill's reason."""
    name, _, peer, decode, dst = pair
    if name not in PULL:
        pytest.skip("early handoffs are for pull transports")
    remote, local, prompt = [2, 3, 4, 9], [7, 8, 0], prompt_for(4)
    token = "early-token-0123456789"
    peer.ask(op="expect", handoff_id="early-handoff-0001", token=token)
    fetch = Fetch(handoff_id="early-handoff-0001", token=token, host="127.0.0.1",
                  port=peer.port, kv_layout=KV_LAYOUT, remote_block_ids=(),
                  local_block_ids=tuple(local), first_block=1, early=True)
    with ThreadPoolExecutor(1) as pool:
        pulled = pool.submit(decode.fetch, fetch, TIMEOUT_S)
        time.sleep(TIMEOUT_S * 1.5)  # longer than decode's bound on silence: Waits keep it
        assert not pulled.done()
        peer.offer("early-handoff-0001", remote, prompt, token=token)
        assert pulled.result(TIMEOUT_S) > 0
    assert_moved(dst, remote[1:], local)
    assert "early-handoff-0001" in peer.released({"early-handoff-0001"})
    peer.ask(op="expect", handoff_id="early-handoff-0002", token=token)
    peer.ask(op="forget", handoff_id="early-handoff-0002", why="its request was aborted")
    with pytest.raises(TransportError, match="its request was aborted"):
        decode.fetch(Fetch(handoff_id="early-handoff-0002", token=token, host="127.0.0.1",
                           port=peer.port, kv_layout=KV_LAYOUT, remote_block_ids=(),
                           local_block_ids=(1,), first_block=0, early=True), TIMEOUT_S)


def test_tail_of_a_handoff(pair):
    """Decode's prefix cache held the first block: only the rest moves."""
    _, _, peer, decode, dst = pair
    remote, prompt = [5, 6, 11, 12], prompt_for(4)
    token = peer.offer("tail", remote, prompt)
    decode.fetch(fetch_of(peer, "tail", token, remote, [20, 21, 3], prompt, first_block=1),
                 TIMEOUT_S)
    assert_moved(dst, [6, 11, 12], [20, 21, 3])
    assert torch.count_nonzero(dst["layer.0"][0]) == 0


def test_many_ranges_and_concurrent_fetches_do_not_mix(pair):
    _, _, peer, decode, dst = pair
    g = torch.Generator().manual_seed(3)
    jobs = []
    local_free = torch.randperm(32, generator=g).tolist()
    for i in range(6):
        remote = torch.randperm(32, generator=g)[:5].tolist()
        local, local_free = local_free[:5], local_free[5:]
        prompt = prompt_for(5)
        jobs.append((f"c{i}", peer.offer(f"c{i}", remote, prompt), remote, local, prompt))
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda j: decode.fetch(fetch_of(peer, *j), TIMEOUT_S), jobs))
    for _, _, remote, local, _ in jobs:
        assert_moved(dst, remote, local)
    assert peer.released({j[0] for j in jobs}) >= {j[0] for j in jobs}


def test_out_of_range_blocks_are_refused(pair):
    name, _, peer, decode, dst = pair
    prompt = prompt_for(2)
    token = peer.offer("oob", [2, 3], prompt)
    with pytest.raises(TransportError, match="out of range"):
        decode.fetch(fetch_of(peer, "oob", token, [2, 3], [0, 99], prompt), TIMEOUT_S)
    if name in PULL:  # prefill checks the ids decode asks for
        with pytest.raises(TransportError, match="out of range"):
            decode.fetch(fetch_of(peer, "oob", token, [2, 99], [0, 1], prompt), TIMEOUT_S)
    assert all(torch.count_nonzero(t) == 0 for t in dst.values())


@pytest.mark.parametrize("forged", ["token", "blocks"])
def test_pull_refuses_a_wrong_token_or_foreign_blocks(pair, forged):
    name, _, peer, decode, _ = pair
    if name not in PULL:
        pytest.skip("store transports have no per-handoff grant")
    prompt = prompt_for(2)
    token = peer.offer("r2", [2, 3], prompt)
    fetch = fetch_of(peer, "r2", "forged" if forged == "token" else token,
                     [2, 5] if forged == "blocks" else [2, 3], [0, 1], prompt)
    with pytest.raises(TransportError, match="wrong token|not part of handoff"):
        decode.fetch(fetch, TIMEOUT_S)
    # A refused read leaves the handoff intact for its rightful owner.
    decode.fetch(fetch_of(peer, "r2", token, [2, 3], [0, 1], prompt), TIMEOUT_S)
    assert "r2" in peer.released({"r2"})


def test_pull_lease_expiry_frees_and_refuses(pair):
    name, _, peer, decode, _ = pair
    if name not in PULL:
        pytest.skip("store transports free blocks once stored")
    prompt = prompt_for(1)
    token = peer.offer("late", [4], prompt, lease_s=0.05)
    assert "late" in peer.released({"late"})
    with pytest.raises(TransportError, match="expired|unknown"):
        decode.fetch(fetch_of(peer, "late", token, [4], [0], prompt), TIMEOUT_S)


def test_dead_peer_is_a_typed_error_within_the_timeout(pair, request):
    name, extra, peer, decode, _ = pair
    prompt = prompt_for(2)
    if name == "lmcache":
        # Nothing was stored for this prompt: decode waits for it, bounded.
        start = time.monotonic()
        with pytest.raises(TransportError, match="exceeded"):
            decode.fetch(fetch_of(peer, "never", "t", [0, 1], [0, 1], prompt), 1.0)
        assert time.monotonic() - start < 2.0
        return
    token = peer.offer("gone", [2, 3], prompt)
    decode.fetch(fetch_of(peer, "warm", "t", [], [], prompt), TIMEOUT_S)  # pooled connection
    peer.kill()
    start = time.monotonic()
    with pytest.raises(TransportError):
        decode.fetch(fetch_of(peer, "gone", token, [2, 3], [0, 1], prompt), TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S + 1.0


def test_lmcache_a_store_that_failed_fails_the_fetch_at_once(pair):
    """Prefill could not store a handoff (here: block ids it does not hold): it marks the
    handoff failed in the store, and the decode waiting for its chunks stops at once with that
    reason instead of polling to its deadline; the blocks still go back to vLLM."""
    name, _, peer, decode, _ = pair
    if name != "lmcache":
        pytest.skip("a store transport's failure: pull transports refuse the Read instead")
    prompt = prompt_for(2)
    token = peer.offer("unstorable", [10**6, 10**6 + 1], prompt)
    assert "unstorable" in peer.released({"unstorable"})
    start = time.monotonic()
    with pytest.raises(TransportError, match="could not store this handoff"):
        decode.fetch(fetch_of(peer, "unstorable", token, [0, 1], [0, 1], prompt), TIMEOUT_S)
    assert time.monotonic() - start < 2.0 < TIMEOUT_S


def test_unreachable_peer_is_a_typed_error_within_the_timeout(pair):
    _, _, peer, decode, _ = pair
    fetch = fetch_of(peer, "x", "t", [0], [0], prompt_for(1))
    fetch = Fetch(**{**fetch.__dict__, "port": free_port()})
    start = time.monotonic()
    with pytest.raises(TransportError):
        decode.fetch(fetch, 1.0)
    assert time.monotonic() - start < 2.0


def test_lmcache_server_gone_is_a_typed_error():
    with LMCacheServer() as server:
        extra = {"transfer_timeout_seconds": 1.0, "lmcache_url": server.url,
                 "lmcache_chunk_tokens": BLOCK_SIZE, "transport": "lmcache"}
        decode, _ = open_transport(msgspec.convert(extra, ConnectorConfig), kv_caches(None),
                                   is_producer=False)
        server.stop()
        start = time.monotonic()
        with pytest.raises(TransportError, match="unreachable|LMCache"):
            decode.fetch(Fetch("x", "t", "", 0, KV_LAYOUT, (0,), (0,), tuple(range(16))), 1.0)
        assert time.monotonic() - start < 2.0
        decode.close()


def test_close_and_recreate(pair):
    name, extra, peer, decode, dst = pair
    prompt = prompt_for(2)
    token = peer.offer("a", [1, 2], prompt)
    decode.fetch(fetch_of(peer, "a", token, [1, 2], [3, 4], prompt), TIMEOUT_S)
    peer.reopen()  # prefill closes its transport, makes a new one
    decode.close()
    config = msgspec.convert({**extra, "transport": name}, ConnectorConfig)
    fresh = kv_caches(None)
    again, _ = open_transport(config, fresh, is_producer=False)
    try:
        prompt = prompt_for(2)
        token = peer.offer("b", [5, 6], prompt)
        again.fetch(fetch_of(peer, "b", token, [5, 6], [3, 4], prompt), TIMEOUT_S)
        assert_moved(fresh, [5, 6], [3, 4])
    finally:
        again.close()


def test_staged_handoff_is_read_from_the_arena(pair):
    """Prefill copied the KV into its arena and gave the paged blocks back to vLLM, which
    overwrote them: decode still gets the KV as it was."""
    name, extra, _, decode, dst = pair
    if name not in PULL:
        pytest.skip("store transports copy KV out to the store instead")
    peer = PeerProcess(name, extra, seed=SEED, stage_blocks=8)
    try:
        remote, arena, local, prompt = [2, 3, 9], [32, 33, 34], [5, 6, 7], prompt_for(3)
        token = peer.offer("staged", arena, prompt, stage_from=remote)
        peer.ask(op="scribble", block_ids=remote)
        decode.fetch(fetch_of(peer, "staged", token, arena, local, prompt), TIMEOUT_S)
        assert_moved(dst, remote, local)
        assert "staged" in peer.released({"staged"})
        with pytest.raises(TransportError, match="out of range"):  # past the arena
            token = peer.offer("past", [39], prompt_for(1), stage_from=[1])
            decode.fetch(fetch_of(peer, "past", token, [40], [0], prompt_for(1)), TIMEOUT_S)
    finally:
        peer.close()


def test_renewed_lease_outlives_its_term_and_a_dropped_one_is_freed(pair):
    """Decode's LeaseKeeper keeps a queued handoff alive past its lease, and a request that
    went away releases its handoff at once."""
    from kvdisagg.connector.leases import Held, LeaseKeeper

    name, _, peer, decode, dst = pair
    if name not in PULL:
        pytest.skip("store transports have no leases")
    keeper = LeaseKeeper(KV_LAYOUT, name, TIMEOUT_S)
    try:
        prompt = prompt_for(2)
        kept = peer.offer("kept", [2, 3], prompt, lease_s=0.6)
        dropped = peer.offer("dropped", [4, 5], prompt, lease_s=30)
        unheld = peer.offer("unheld", [6], prompt, lease_s=0.6)
        keeper.hold("d1", Held("kept", kept, "127.0.0.1", (peer.port,), 0.6))
        keeper.hold("d2", Held("dropped", dropped, "127.0.0.1", (peer.port,), 30))
        time.sleep(2.0)  # three leases' worth
        keeper.drop("d2", release=True)
        assert peer.released({"dropped", "unheld"}) >= {"dropped", "unheld"}
        decode.fetch(fetch_of(peer, "kept", kept, [2, 3], [0, 1], prompt), TIMEOUT_S)
        assert_moved(dst, [2, 3], [0, 1])
        with pytest.raises(TransportError, match="expired|released"):
            decode.fetch(fetch_of(peer, "unheld", unheld, [6], [2], prompt), TIMEOUT_S)
        assert keeper.renewals >= 3
    finally:
        keeper.close()


def test_peer_stalled_mid_service_is_a_typed_error_then_serves(pair):
    """A prefill worker that stops answering (SIGSTOP) costs a pull its timeout, not a hang;
    once it runs again, the next pull on the same transport works."""
    import signal

    name, _, peer, decode, dst = pair
    if name not in PULL:
        pytest.skip("the store is another process")
    prompt = prompt_for(2)
    token = peer.offer("s1", [2, 3], prompt)
    token2 = peer.offer("s2", [4, 5], prompt)
    peer.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(TransportError):
            decode.fetch(fetch_of(peer, "s1", token, [2, 3], [0, 1], prompt), 1.0)
        assert time.monotonic() - start < 2.0
    finally:
        peer.proc.send_signal(signal.SIGCONT)
    # The resumed prefill sets up no transport peer for the abandoned Hello (nccl: a group
    # formation that would wait out its timeout), so the next pull needs no extra room.
    decode.fetch(fetch_of(peer, "s2", token2, [4, 5], [6, 7], prompt), TIMEOUT_S)
    assert_moved(dst, [4, 5], [6, 7])


@pytest.mark.parametrize("checksum", [True, False], ids=["checked", "unchecked"])
def test_a_byte_flipped_in_flight_fails_the_fetch_and_nothing_leaks(pair, checksum):
    """Decode's transport flips one byte of what landed (tests.support.faults): the fetch
    fails with a checksum error naming the handoff and the peer, prefill frees the handoff,
    and the next clean pull works. Unchecked, the flip goes through: the check is what
    catches it."""
    name, extra, peer, decode, dst = pair
    config = msgspec.convert({**extra, "kv_checksum": checksum, "transport":
                              f"tests.support.faults:Corrupting{CORRUPTING[name]}Transport"},
                             ConnectorConfig)
    got = kv_caches(None)
    corrupting, _ = open_transport(config, got, is_producer=False)
    try:
        remote, local, prompt = [2, 3, 9], [4, 5, 6], prompt_for(3)
        token = peer.offer("bad", remote, prompt)
        fetch = fetch_of(peer, "bad", token, remote, local, prompt)
        if checksum:
            where = "LMCache chunk" if name == "lmcache" else f"handoff bad from prefill " \
                                                               f"127.0.0.1:{peer.port}"
            with pytest.raises(ChecksumMismatch, match=f"checksum mismatch .*{where}"):
                corrupting.fetch(fetch, TIMEOUT_S)
        else:
            corrupting.fetch(fetch, TIMEOUT_S)
            src = kv_caches(SEED)
            differ = sum(int(torch.count_nonzero(got[k][local].view(torch.uint8)
                                                 != src[k][remote].view(torch.uint8)))
                         for k in src)
            # one flipped byte per pull (lmcache: per chunk GET)
            assert differ == (len(corrupting.chunks(prompt)) if name == "lmcache" else 1)
        assert "bad" in peer.released({"bad"})  # freed (pulled or stored), not leaked
    finally:
        corrupting.close()
    prompt = prompt_for(2)
    token = peer.offer("good", [7, 8], prompt)
    decode.fetch(fetch_of(peer, "good", token, [7, 8], [0, 1], prompt), TIMEOUT_S)
    assert_moved(dst, [7, 8], [0, 1])


# ---- instances sharded differently -----------------------------------------------------------

LAYERS = 2
SHAPES = {  # id: (the model's KV heads, prefill, decode)
    "tp2-to-tp1pp2": (2, Shape(2), Shape(1, (0, 1))),  # heads gathered, layers split by stage
    "tp1pp2-to-tp2": (2, Shape(1, (0, 1)), Shape(2)),  # heads split, layers from both stages
    "mqa-tp2-to-tp1": (1, Shape(2), Shape(1)),  # one KV head on two ranks: a replica released
}


@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize("name", TRANSPORTS)
def test_sharded_instances_pull_each_ranks_heads_and_layers(name, case, request):
    """Each decode rank ends up with exactly its heads of its layers (the model's KV, whatever
    rank held it on prefill); each prefill rank frees the handoff only after the last decode
    rank reading it said Done (a replica nobody reads: after its release)."""
    kv_heads, prefill, decode = SHAPES[case]
    extra = extra_config(name, request)
    config = msgspec.convert({**extra, "transport": name}, ConnectorConfig)
    geo = geometry(kv_heads, LAYERS)
    peers: list[PeerProcess] = []
    decodes = []
    try:
        for p in range(prefill.world):
            pp, tp = divmod(p, prefill.tp)
            peers.append(PeerProcess(name, extra, seed=SEED, rank=p, shape=prefill,
                                     shard=(prefill.layers(pp, LAYERS),
                                            prefill.heads(tp, kv_heads), kv_heads)))
        for d in range(decode.world):
            pp, tp = divmod(d, decode.tp)
            caches = shard_caches(None, decode.layers(pp, LAYERS), decode.heads(tp, kv_heads),
                                  kv_heads)
            transport, _ = open_transport(config, caches, is_producer=False, geometry=geo,
                                          rank=d, shape=decode)
            decodes.append((transport, caches, pp, tp))
        remote, local, prompt = [2, 3, 9], [7, 8, 0], prompt_for(3)
        token = "t-" + case
        for peer in peers:
            peer.offer("h", remote, prompt, token=token)
        parts = plan(prefill, decode, kv_heads, LAYERS)

        def pull(d: int) -> int:
            transport = decodes[d][0]
            return sum(transport.fetch(Fetch(
                handoff_id="h", token=token, host="127.0.0.1", port=peers[part.src].port,
                kv_layout=KV_LAYOUT, remote_block_ids=tuple(remote),
                local_block_ids=tuple(local), prompt_token_ids=tuple(prompt), part=part,
                prefill=prefill), TIMEOUT_S) for part in parts[d])

        pull(0)
        if name in PULL:  # a prefill rank another decode rank still reads keeps the handoff
            waiting = {part.src for part in parts[0] if part.readers > 1}
            for p in waiting:
                assert "h" not in peers[p].released({"h"}, within_s=0.3), (case, p)
        with ThreadPoolExecutor(decode.world) as pool:
            list(pool.map(pull, range(1, decode.world)))
        for _transport, caches, pp, tp in decodes:
            heads = list(decode.heads(tp, kv_heads))
            for layer in decode.layers(pp, LAYERS):
                want = model_kv(SEED, layer, kv_heads)[remote][:, heads]
                assert torch.equal(caches[f"layer.{layer}"][local], want), (case, pp, tp, layer)
                others = [b for b in range(32) if b not in local]
                assert torch.count_nonzero(caches[f"layer.{layer}"][others]) == 0
        if name in PULL:
            for p, peer in enumerate(peers):
                assert "h" in peer.released({"h"}), (case, p)
    finally:
        for transport, *_ in decodes:
            transport.close()
        for peer in peers:
            peer.close()


@pytest.mark.parametrize("name", sorted(PULL))
def test_a_pair_that_cannot_work_is_refused_naming_what_differs(name, request):
    """Hello of a decode whose block size and KV heads differ: refused, both named."""
    extra = extra_config(name, request)
    peer = PeerProcess(name, extra, seed=SEED, shard=([0, 1], [0, 1], 2), shape=Shape(1))
    config = msgspec.convert({**extra, "transport": name}, ConnectorConfig)
    theirs = msgspec.structs.replace(geometry(2, LAYERS), block_size=32, kv_heads=4)
    decode, _ = open_transport(config, shard_caches(None, [0, 1], [0, 1], 2),
                               is_producer=False, geometry=theirs)
    decode.kv_layout = theirs.fingerprint()
    try:
        prompt = prompt_for(1)
        token = peer.offer("x", [1], prompt)
        fetch = Fetch(handoff_id="x", token=token, host="127.0.0.1", port=peer.port,
                      kv_layout=decode.kv_layout, remote_block_ids=(1,), local_block_ids=(0,))
        with pytest.raises(IncompatiblePeerError, match="block_size: prefill 16, decode 32; "
                                                 "kv_heads: prefill 2, decode 4"):
            decode.fetch(fetch, TIMEOUT_S)
    finally:
        decode.close()
        peer.close()


# ---- liveness, not duration ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PULL))
def test_a_slow_live_prefill_never_fails_a_pull(name, request):
    """The Read comes long before prefill's engine offers the handoff (a step that takes three
    transfer timeouts, on a starved host): prefill says it is alive (Wait) and the pull waits
    for the offer, then moves the bytes. A stopped prefill is an error after one timeout (see
    test_peer_stalled_mid_service...), a killed one at once."""
    extra = extra_config(name, request) | {"transfer_timeout_seconds": 1.0}
    peer = PeerProcess(name, extra, seed=SEED)
    config = msgspec.convert({**extra, "transport": name}, ConnectorConfig)
    dst = kv_caches(None)
    decode, _ = open_transport(config, dst, is_producer=False)
    try:
        prompt = prompt_for(2)
        assert peer.ask(op="step", running=True) == {"ok": True}  # a long step begins
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            pulled = pool.submit(decode.fetch, fetch_of(peer, "late", "tok", [2, 3], [0, 1],
                                                        prompt), 1.0)
            time.sleep(3.0)
            assert not pulled.done()
            peer.offer("late", [2, 3], prompt, token="tok")  # the next step offers it
            peer.ask(op="step", running=False)
            pulled.result(timeout=10)
        assert time.monotonic() - started >= 3.0
        assert_moved(dst, [2, 3], [0, 1])
        # An id no step offers is refused once the engine took two steps without it.
        peer.ask(op="step", running=True)
        with ThreadPoolExecutor(1) as pool:
            refused = pool.submit(decode.fetch, fetch_of(peer, "never", "tok", [4], [2],
                                                         prompt), 1.0)
            time.sleep(0.5)
            for running in (False, True, False, True):
                peer.ask(op="step", running=running)
            with pytest.raises(TransportError, match="unknown"):
                refused.result(timeout=10)
        peer.kill()
        start = time.monotonic()
        with pytest.raises(TransportError):
            decode.fetch(fetch_of(peer, "gone", "tok", [4], [2], prompt), 30.0)
        assert time.monotonic() - start < 2.0  # a dead peer: its connections reset at once
    finally:
        decode.close()
        peer.close()
