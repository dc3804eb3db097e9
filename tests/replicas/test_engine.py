"""The engine (no Ray), its core in a process of its own as in a replica: continuous batching
gives each request exactly what it gets alone, blocks come back after finishing and after aborts,
stop rules and seeds hold, and one row's failure fails only its request. The tests of scheduling
alone (preemption, held arrivals, async scheduling) run their cores in this process: the same
engine, without the ~5 s of a core process's start each."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import subprocess
import sys

import pytest
import torch

from replicas import deployment
from replicas.channel import Channeled, ChannelOpen, NeedChannel, decode
from replicas.core_client import SUSPECT_SILENCE_S
from replicas.core_protocol import HEARTBEAT_S
from replicas.deployment import LLMServer, ReplicaConfig
from replicas.embedded import EMBEDDED_MODEL_ID
from replicas.request import EngineError, GenerateRequest, SamplingParams
from serve_app.inbox import Inbox


NGRAM = "replicas.logits_processors:NoRepeatNGram"
FAILS = "tests.replicas.processors:FailsAfter"
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def server(request: pytest.FixtureRequest) -> LLMServer:
    """The engine's tests run with each step scheduled after the one before it returns, and
    with it scheduled while that one runs (async scheduling, replicas/engine.py)."""
    server = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=512,
                                     kv_cache_gib=0.05, max_num_seqs=32,
                                     max_num_batched_tokens=256, block_size=8,
                                     logits_processors=(NGRAM, FAILS),
                                     # above the test's own, so that no privilege is needed
                                     core_niceness=os.getpriority(os.PRIO_PROCESS, 0) + 1,
                                     async_scheduling=request.param))
    yield server
    server.close()


@pytest.fixture(scope="module")
def unpaced() -> LLMServer:
    """No message budget and so no stream floor: the core sends every step's outputs."""
    server = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=512,
                                     kv_cache_gib=0.05, block_size=8,
                                     stream_messages_per_s=0.0))
    yield server
    server.close()


async def _settled(server: LLMServer) -> dict:
    """The core's counters once nothing runs (aborts are applied between steps)."""
    for _ in range(100):
        stats = await server.fresh_stats()
        if stats["num_used_blocks"] == 0 and stats["num_running"] + stats["num_waiting"] == 0:
            return stats
        await asyncio.sleep(0.02)
    return stats


async def test_the_replicas_front_imports_neither_torch_nor_the_engine() -> None:
    """The front only starts, supervises and relays its core: a Serve replica process without
    torch is ~200 MB and ~2.5 s of start-up CPU lighter."""
    code = ("import sys, replicas.deployment; "
            "print(sorted(m for m in ('torch', 'transformers', 'replicas.engine') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


async def test_the_core_runs_in_a_process_of_its_own(server: LLMServer) -> None:
    import psutil

    pid = (await server.fresh_stats())["core_pid"]
    assert pid != os.getpid() and server.info()["pid"] == pid
    core = psutil.Process(pid)
    assert core.ppid() == os.getpid()
    assert "EngineCore" in " ".join(core.cmdline())
    # the configured niceness, in every thread the core has started (OpenMP's team after a step)
    await _collect(server, GenerateRequest("nice", (5, 6, 7), SamplingParams(max_tokens=2)))
    wanted = os.getpriority(os.PRIO_PROCESS, 0) + 1
    threads = [t.id for t in core.threads()]
    assert len(threads) > 2
    assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in threads} == {wanted}


async def test_a_core_run_under_shardserve_core_profile_leaves_its_profile(
        tmp_path, monkeypatch) -> None:
    import pstats

    monkeypatch.setenv("SHARDSERVE_CORE_PROFILE", str(tmp_path / "prof"))
    server = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=128,
                                     kv_cache_gib=0.01, max_num_seqs=2))
    try:
        pid = (await server.fresh_stats())["core_pid"]
        out = await _collect(server, GenerateRequest("p", (5, 6, 7), SamplingParams(
            max_tokens=3, ignore_eos=True)))
        assert len(_tokens(out[0])) == 3
    finally:
        server.close()
    stats = pstats.Stats(str(tmp_path / "prof" / f"core-{pid}.prof"))
    # the engine's own steps are in it, not only the process's start
    assert any(name == "_postprocess" for _, _, name in stats.stats)  # type: ignore[attr-defined]


async def _collect(server: LLMServer, req: GenerateRequest) -> dict[int, list]:
    out: dict[int, list] = {}
    async for batches in server.generate(req):
        for b in batches:
            out.setdefault(b.choice_index, []).append(b)
    return out


async def _collect_channeled(server: LLMServer, req: GenerateRequest, ingress: str) -> list:
    """What `generate` yields for a request of `ingress` (a `Channeled` marker where its channel
    is open)."""
    return [m async for m in server.generate(req, ingress)]


def _tokens(batches: list) -> list[int]:
    return [t for b in batches for t in b.token_ids]


def _prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(10, 3900) for _ in range(rng.randrange(3, 120))) for _ in range(n)]


async def test_32_concurrent_requests_match_each_alone(server: LLMServer) -> None:
    prompts = _prompts(32)
    lengths = [random.Random(i).randrange(1, 40) for i in range(32)]
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.0,
                                                       ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompts, lengths))]
    alone = []
    for r in reqs:
        alone.append(_tokens((await _collect(server, r))[0]))
    together = await asyncio.gather(*(_collect(server, r) for r in reqs))
    for r, a, t in zip(reqs, alone, together):
        assert len(a) == r.params.max_tokens
        assert _tokens(t[0]) == a, r.request_id
        assert t[0][-1].finish_reason == "length"
    stats = await _settled(server)
    assert stats["num_used_blocks"] == 0 and stats["num_steps"] > 0


async def test_abort_frees_blocks(server: LLMServer) -> None:
    reqs = [GenerateRequest(f"a{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
            for i, p in enumerate(_prompts(8, seed=1))]

    async def consume_a_little(r: GenerateRequest) -> None:
        gen = server.generate(r)
        await gen.__anext__()
        await gen.aclose()  # the consumer goes away, as a disconnecting client does

    await asyncio.gather(*(consume_a_little(r) for r in reqs))
    assert (await _settled(server))["num_used_blocks"] == 0


async def test_cancelled_task_aborts(server: LLMServer) -> None:
    req = GenerateRequest("c1", _prompts(1, seed=2)[0],
                          SamplingParams(max_tokens=300, ignore_eos=True))
    task = asyncio.create_task(_collect(server, req))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await _settled(server))["num_used_blocks"] == 0


async def test_seed_gives_same_tokens_alone_and_in_a_batch(server: LLMServer) -> None:
    prompt = _prompts(1, seed=3)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _tokens((await _collect(server, GenerateRequest("s-alone", prompt, params)))[0])
    others = [GenerateRequest(f"noise{i}", p, SamplingParams(max_tokens=30, temperature=1.0,
                                                             ignore_eos=True))
              for i, p in enumerate(_prompts(16, seed=4))]
    results = await asyncio.gather(_collect(server, GenerateRequest("s-batch", prompt, params)),
                                   *(_collect(server, r) for r in others))
    assert _tokens(results[0][0]) == alone
    different = _tokens((await _collect(server, GenerateRequest(
        "s-other", prompt, SamplingParams(max_tokens=24, seed=99, ignore_eos=True))))[0])
    assert different != alone


async def test_n_choices_ride_one_request(server: LLMServer) -> None:
    out = await _collect(server, GenerateRequest(
        "n3", _prompts(1, seed=5)[0], SamplingParams(max_tokens=10, seed=7, ignore_eos=True), n=3))
    assert sorted(out) == [0, 1, 2]
    assert all(len(_tokens(out[i])) == 10 for i in range(3))
    assert len({tuple(_tokens(out[i])) for i in range(3)}) > 1


async def test_stop_token_ids_and_min_tokens(server: LLMServer) -> None:
    prompt = _prompts(1, seed=6)[0]
    free = _tokens((await _collect(server, GenerateRequest(
        "free", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))))[0])
    stop_at = free[5]
    first = free.index(stop_at)
    out = (await _collect(server, GenerateRequest(
        "stop", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                       stop_token_ids=(stop_at,)))))[0]
    assert _tokens(out) == free[:first + 1]
    assert out[-1].finish_reason == "stop" and out[-1].stop_reason == stop_at
    # min_tokens bans the stop token until enough tokens exist
    out = (await _collect(server, GenerateRequest(
        "minstop", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=(stop_at,), min_tokens=first + 2))))[0]
    assert len(_tokens(out)) >= first + 2


async def test_prompt_too_long_is_rejected(server: LLMServer) -> None:
    with pytest.raises(EngineError) as err:
        await _collect(server, GenerateRequest("long", tuple(range(10, 500)),
                                               SamplingParams(max_tokens=100)))
    assert err.value.status == 400 and "maximum context length" in err.value.message


async def test_prefix_cache_reuses_full_blocks(server: LLMServer) -> None:
    prefix = tuple(range(100, 164))  # 8 full blocks of 8
    a = await _collect(server, GenerateRequest("p1", prefix + (5, 6), SamplingParams(
        max_tokens=2, temperature=0.0)))
    b = await _collect(server, GenerateRequest("p2", prefix + (7, 8), SamplingParams(
        max_tokens=2, temperature=0.0)))
    assert a[0][0].num_cached_tokens == 0
    assert b[0][0].num_cached_tokens == 64
    salted = await _collect(server, GenerateRequest("p3", prefix + (7, 8), SamplingParams(
        max_tokens=2, temperature=0.0), cache_salt="tenant-b"))
    assert salted[0][0].num_cached_tokens == 0
    assert _tokens(salted[0]) == _tokens(b[0])


async def test_allowlisted_logits_processor_applies(server: LLMServer) -> None:
    prompt = _prompts(1, seed=8)[0]
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True,
                            logits_processors=((NGRAM, '{"n": 2}'),))
    out = _tokens((await _collect(server, GenerateRequest("ngram", prompt, params)))[0])
    bigrams = list(zip(out, out[1:]))
    assert len(bigrams) == len(set(bigrams))
    with pytest.raises(EngineError):
        await _collect(server, GenerateRequest("bad-proc", prompt, SamplingParams(
            max_tokens=2, logits_processors=(("os:system", "{}"),))))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
async def test_preemption_by_recompute_keeps_outputs_exact(async_scheduling: bool) -> None:
    # a cache of one full-length sequence (128 tokens) for 8 requests that need 80 each
    small = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=128,
                                    kv_cache_gib=1e-9, max_num_seqs=8, block_size=16,
                                    enable_prefix_caching=False,
                                    async_scheduling=async_scheduling), in_process=True)
    try:
        assert (await small.fresh_stats())["num_blocks"] == 8
        # seeded sampling too: a sequence preempted while its step runs keeps that step's token
        reqs = [GenerateRequest(f"pre{i}", p[:40] + (1,) * max(0, 40 - len(p)),
                                SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 1.0,
                                               seed=i, ignore_eos=True))
                for i, p in enumerate(_prompts(8, seed=9))]
        alone = [_tokens((await _collect(small, r))[0]) for r in reqs]
        together = await asyncio.gather(*(_collect(small, r) for r in reqs))
        assert [_tokens(t[0]) for t in together] == alone
        stats = await _settled(small)
        assert stats["preemptions"] > 0 and stats["num_used_blocks"] == 0
    finally:
        small.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
async def test_shards_get_block_table_deltas_and_hold_the_engines_tables(
        async_scheduling: bool) -> None:
    """Each step sends a row only the blocks its table gained (all of it after a preemption),
    and drops the tables of finished, aborted and preempted sequences: after every step the
    runner's table of each row is the engine's as the step was built, and decode rows carry at
    most one block. (Taken when the step is built: under async scheduling the loop may grow,
    free or preempt a table for the step behind while this one runs, as an H200 run showed.)"""
    small = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=128,
                                    kv_cache_gib=1e-9, max_num_seqs=8, block_size=16,
                                    async_scheduling=async_scheduling),
                      in_process=True)
    engine = small.core.engine
    runner = engine.executor.worker.runner
    execute, step_input = engine.executor.execute, engine._step_input
    checked = {"steps": 0, "resent": 0}
    built: list[tuple[dict[int, list[int]], set[int]]] = []  # FIFO: one compute thread

    def build(scheduled):
        step = step_input(scheduled)
        built.append(({s.seq.seq_id: list(s.seq.block_table) for s in scheduled},
                      set(engine._shipped)))
        return step

    def check(step):
        out = execute(step)
        tables, shipped = built.pop(0)
        for row in step.rows:
            assert runner.block_tables.table(row.seq_id) == tables[row.seq_id]
            if len(row.token_ids) == 1 and row.start % 16:
                assert row.blocks == ()  # a decode row within its last block: no block ids
            checked["resent"] += len(row.blocks) > 1 and row.start > 0
        assert set(runner.block_tables.row_of) <= shipped
        checked["steps"] += 1
        return out

    engine._step_input = build
    engine.executor.execute = check
    try:
        reqs = [GenerateRequest(f"delta{i}", p[:40] + (1,) * max(0, 40 - len(p)),
                                SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                n=1 + i % 2)
                for i, p in enumerate(_prompts(6, seed=9))]

        async def abort_early(r: GenerateRequest) -> None:
            gen = small.generate(r)
            await gen.__anext__()
            await gen.aclose()  # the consumer goes away: the request is aborted
        await asyncio.gather(*(_collect(small, r) for r in reqs), abort_early(
            GenerateRequest("delta-abort", (5,) * 30, SamplingParams(max_tokens=80))))
        stats = await _settled(small)
        assert stats["preemptions"] > 0 and checked["resent"] > 0 and checked["steps"] > 40
        await _collect(small, GenerateRequest("last", (5, 6, 7), SamplingParams(max_tokens=2)))
        assert len(runner.block_tables) <= 1  # only the last request's, if it is not yet dropped
    finally:
        small.close()


async def test_the_replica_reports_the_message_budget_its_ingresses_apply(
        server: LLMServer, unpaced: LLMServer) -> None:
    """The replica reports the budget: unset, by where the model runs (500 messages a second on
    GPUs, 50 and a 40 ms floor per request on CPUs); set, the setting, with no floor. Without
    a floor the replica sends every step's tokens (the ingress groups them:
    serve_app/channels.py)."""
    stats = server.stats()
    assert server.config.stream_messages_per_s is None
    gpu = torch.cuda.is_available()
    assert (stats["stream_messages_per_s"], stats["stream_floor_s"]) == (
        (500.0, 0.0) if gpu else (50.0, 0.04))
    assert (unpaced.stats()["stream_messages_per_s"], unpaced.stats()["stream_floor_s"]) == (
        0.0, 0.0)
    prompt = _prompts(1, seed=7)[0]
    every = await _collect(unpaced, GenerateRequest("si-1", prompt, SamplingParams(
        max_tokens=14, temperature=0.0, ignore_eos=True)))
    sizes = [len(b.token_ids) for b in every[0]]
    # one by one, save the few a busy event loop lets pile up between two reads (the first
    # included: under async scheduling the second step may land before the first is read)
    assert sum(sizes) == 14 and len(sizes) >= 10, sizes


async def test_a_channel_carries_its_requests_one_message_per_step(unpaced: LLMServer) -> None:
    """Requests sent while their ingress's channel is open come over it: `generate` yields one
    `Channeled` and ends with the request, the tokens are exactly those of direct calls, and
    one message carries every request's step (with no stream floor: under one, a message holds
    the steps of a floor, below). Closing the channel fails the requests on it."""
    prompts = _prompts(4, seed=13)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    direct = await asyncio.gather(*(_collect(unpaced, GenerateRequest(f"ch-d{i}", p, params))
                                    for i, p in enumerate(prompts)))
    channel = unpaced.channel(ChannelOpen("this-replica", "ingress-1"))
    assert decode(await anext(channel)) == {}
    calls = [asyncio.create_task(_collect_channeled(
        unpaced, GenerateRequest(f"ch-c{i}", p, params), "ingress-1"))
             for i, p in enumerate(prompts)]
    got: dict[str, list] = {f"ch-c{i}": [] for i in range(4)}
    messages = 0
    while not all(b and b[-1].finish_reason for b in got.values()):
        message = decode(await anext(channel))
        messages += 1
        for rid, batches in message.items():
            got[rid].extend(batches)
    assert [await c for c in calls] == [[Channeled(unpaced.replica_id)]] * 4
    assert [_tokens(got[f"ch-c{i}"]) for i in range(4)] == [_tokens(d[0]) for d in direct]
    # the four requests' steps together (prefills may split), a step a message: the steps that
    # came while this reader was behind go in one (Channel.take; under a 2-core suite's load
    # now and then two), never a floor's worth, which would be a few messages for all 16
    assert 8 <= messages <= 16 + 2
    # a request still on a channel that closes fails (its ingress can no longer get its tokens)
    long = asyncio.create_task(_collect_channeled(unpaced, GenerateRequest(
        "ch-long", prompts[0], dataclasses.replace(params, max_tokens=100)), "ingress-1"))
    while "ch-long" not in decode(await anext(channel)):
        pass
    await channel.aclose()
    with pytest.raises(EngineError, match="broke"):
        await long
    assert "ch-long" not in unpaced.core.streams.outboxes


async def test_a_direct_channel_takes_rows_from_the_core_to_the_ingress_socket(
        unpaced: LLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ingress on the replica's node names its inbox when it opens the channel: the core
    sends that ingress's requests' rows there itself, the channel call carries none, and
    `generate` still ends with the request (its last batch reaches the front too). Closing
    the channel fails what is still on it."""
    monkeypatch.setattr(deployment, "node_id", lambda: "node-1")
    got: dict[str, list] = {}

    def take(message: bytes) -> None:
        for rid, batches in decode(message).items():
            got.setdefault(rid, []).extend(batches)
    inbox = Inbox(take)
    try:
        channel = unpaced.channel(ChannelOpen("this-replica", "ingress-d", inbox.address,
                                              "node-1"))
        assert decode(await anext(channel)) == {}
        assert unpaced.channels["ingress-d"].direct
        prompts = _prompts(3, seed=21)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        direct = await asyncio.gather(*(_collect(unpaced, GenerateRequest(f"dc-r{i}", p, params))
                                        for i, p in enumerate(prompts)))
        calls = await asyncio.gather(*(_collect_channeled(
            unpaced, GenerateRequest(f"dc-{i}", p, params), "ingress-d")
            for i, p in enumerate(prompts)))
        assert calls == [[Channeled(unpaced.replica_id)]] * 3
        for _ in range(100):  # the inbox's reader thread hands messages over
            if all(got.get(f"dc-{i}") and got[f"dc-{i}"][-1].finish_reason for i in range(3)):
                break
            await asyncio.sleep(0.02)
        assert [_tokens(got[f"dc-{i}"]) for i in range(3)] == [_tokens(d[0]) for d in direct]
        long = asyncio.create_task(_collect_channeled(unpaced, GenerateRequest(
            "dc-long", prompts[0], dataclasses.replace(params, max_tokens=100)), "ingress-d"))
        while "dc-long" not in got:
            await asyncio.sleep(0.01)
        await channel.aclose()
        with pytest.raises(EngineError, match="broke"):
            await long
        assert unpaced.core.ingresses == {}
    finally:
        inbox.close()


async def test_under_a_stream_floor_the_core_sends_a_message_per_floor() -> None:
    """Under a floor (CPUs by default: 40 ms) each request's tokens wait at the ingress for at
    least the floor, so the core sends its front at most one message per floor
    (replicas/output_pacer.py), a request's first and last batches at once, and the channel one
    for each."""
    # longer than the CPU default, so that a slow machine's steps still share messages
    paced = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=128,
                                    kv_cache_gib=0.01, stream_floor_s=0.2))
    try:
        assert paced.stats()["stream_floor_s"] == 0.2
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        channel = paced.channel(ChannelOpen("this-replica", "ingress-2"))
        assert decode(await anext(channel)) == {}
        call = asyncio.create_task(_collect_channeled(paced, GenerateRequest(
            "floor", _prompts(1, seed=3)[0], params), "ingress-2"))
        batches: list = []
        messages = 0
        while not batches or batches[-1].finish_reason is None:
            batches += decode(await anext(channel)).get("floor", [])
            messages += 1
        await call
        await channel.aclose()
        assert sum(len(b.token_ids) for b in batches) == 40
        assert messages < len(batches)  # a message held several steps' rows
        assert len(batches[0].token_ids) == 1 and messages >= 2  # the first went alone
    finally:
        paced.close()


async def test_a_request_waits_for_its_ingress_to_open_the_channel(
        server: LLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a replica without its ingress's channel a request asks for one (`NeedChannel`) and
    starts once it is open, channeled; none within OPEN_WAIT_S, and it streams by itself."""
    from replicas import deployment
    monkeypatch.setattr(server, "replica_id", "this-replica")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    call = server.generate(GenerateRequest("ch-wait", _prompts(1)[0], params), "ingress-3")
    assert await anext(call) == NeedChannel("this-replica")
    started = asyncio.ensure_future(anext(call))
    await asyncio.sleep(0.05)
    assert not started.done()  # waiting for the channel
    channel = server.channel(ChannelOpen("this-replica", "ingress-3"))
    assert decode(await anext(channel)) == {}
    assert await started == Channeled("this-replica")
    tokens: list = []
    while not tokens or tokens[-1].finish_reason is None:
        tokens += decode(await anext(channel)).get("ch-wait", [])
    assert sum(len(b.token_ids) for b in tokens) == 4
    with pytest.raises(StopAsyncIteration):
        await anext(call)
    await channel.aclose()
    monkeypatch.setattr(deployment, "OPEN_WAIT_S", 0.05)
    alone = [m async for m in server.generate(GenerateRequest("ch-none", _prompts(1)[0], params),
                                              "ingress-4")]
    assert alone[0] == NeedChannel("this-replica")
    assert sum(len(b.token_ids) for batches in alone[1:] for b in batches) == 4


async def test_an_idle_channel_ends(server: LLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve drains a replica it stops by waiting for its calls: a channel with no request on
    it ends after IDLE_S (its ingress opens it again with its next request here)."""
    from replicas import deployment
    monkeypatch.setattr(deployment, "IDLE_S", 0.05)
    channel = server.channel(ChannelOpen("this-replica", "ingress-2"))
    assert decode(await anext(channel)) == {}
    assert "ingress-2" in server.channels
    with pytest.raises(StopAsyncIteration):
        async with asyncio.timeout(5):
            await anext(channel)
    assert "ingress-2" not in server.channels


async def test_stop_choice_ends_one_choice_and_takes_its_extra_tokens_off_the_counters(
        server: LLMServer) -> None:
    """The ingress found a stop string after 3 tokens of choice 0 (the engine had made more):
    that choice ends, its row is freed, choice 1 runs on to max_tokens, and the engine's
    generation counter grows by exactly what the client got."""
    before = (await server.fresh_stats())["generation_tokens"]
    req = GenerateRequest("stop-choice", _prompts(1, seed=7)[0],
                          SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), n=2)
    got: dict[int, list] = {0: [], 1: []}
    sent = False
    async for batches in server.generate(req):
        for b in batches:
            got[b.choice_index].append(b)
        if not sent and len(_tokens(got[0])) >= 5:
            server.stop_choice("stop-choice", 0, 3)
            sent = True
    assert got[0][-1].finish_reason == "stop" and got[1][-1].finish_reason == "length"
    assert len(_tokens(got[0])) < 60 and len(_tokens(got[1])) == 60
    assert (await server.fresh_stats())["generation_tokens"] - before == 3 + 60
    # a stop for a choice that had already finished still corrects the counter
    before = (await server.fresh_stats())["generation_tokens"]
    req = dataclasses.replace(req, request_id="stop-late", n=1)
    await _collect(server, req)
    server.stop_choice("stop-late", 0, 10)
    await asyncio.sleep(0.1)  # the core's loop applies it
    stats = await _settled(server)
    assert stats["generation_tokens"] - before == 10 and stats["num_used_blocks"] == 0


async def test_a_stop_that_comes_after_the_abort_still_corrects_the_counter(
        server: LLMServer) -> None:
    """The ingress cut the choice at 4 tokens and, its stop message slow on the board's path,
    cancelled the call: the abort reaches the engine first. The tokens made past the stop
    still leave the generation counter when the stop comes (CI once counted 3 more tokens
    than the clients got under load: tests/serve_app/test_stops.py)."""
    before = (await server.fresh_stats())["generation_tokens"]
    req = GenerateRequest("stop-after-abort", _prompts(1, seed=8)[0],
                          SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    gen = server.generate(req)
    seen: list[int] = []
    while len(seen) < 8:
        seen += _tokens(list(await anext(gen)))
    await gen.aclose()  # the abort
    aborted = await _settled(server)
    assert aborted["generation_tokens"] - before >= 8
    server.stop_choice("stop-after-abort", 0, 4)
    await asyncio.sleep(0.1)  # the core's loop applies it
    stats = await _settled(server)
    assert stats["generation_tokens"] - before == 4 and stats["num_used_blocks"] == 0


async def test_arrivals_held_for_decode_steps_get_exactly_their_tokens() -> None:
    # max_waiting_steps (on by default only where decode steps are CUDA graphs): requests that
    # arrive beside decoding ones wait a few steps, then join, with the tokens they get alone
    held = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=256,
                                   kv_cache_gib=0.02, max_num_seqs=16, max_waiting_steps=3),
                     in_process=True)
    try:
        assert held.info()["max_waiting_steps"] == 3
        reqs = [GenerateRequest(f"hold{i}", p, SamplingParams(max_tokens=24, temperature=0.0,
                                                              ignore_eos=True))
                for i, p in enumerate(_prompts(8, seed=5))]
        alone = [_tokens((await _collect(held, r))[0]) for r in reqs]
        # a long request is decoding when the others arrive (not left to timing: a tiny model's
        # 24 tokens can all be made before a staggered arrival comes)
        long = GenerateRequest("hold-long", _prompts(1, seed=6)[0][:8],
                               SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        stream = held.generate(long)
        assert _tokens(await anext(stream))

        async def late(i: int, r: GenerateRequest) -> dict[int, list]:
            await asyncio.sleep(0.002 * i)
            return await _collect(held, r)
        together = await asyncio.gather(*(late(i, r) for i, r in enumerate(reqs)))
        assert [_tokens(t[0]) for t in together] == alone
        assert len(_tokens([b async for bs in stream for b in bs])) > 0
        stats = await _settled(held)
        assert stats["held_steps"] > 0  # arrivals did sit decode steps out
    finally:
        held.close()


async def test_prompt_logprobs_survive_preemption_and_are_computed_once_for_n() -> None:
    """A KV budget of one full-length sequence and chunked prefill: requests are preempted
    mid-prefill and computed again; each prompt token still gets exactly one entry, equal to
    the entry computed without preemption. With n = 2 only choice 0 carries them."""
    tight = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=256, kv_cache_gib=0.0,
                                    max_num_seqs=8, max_num_batched_tokens=32, block_size=8),
                      in_process=True)
    prompts = _prompts(6, seed=11)
    prompts = [p + p for p in prompts]  # long enough to need several prefill chunks
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    async def run(i: int, prompt: tuple[int, ...], n: int = 1) -> dict[int, list]:
        return await _collect(tight, GenerateRequest(f"plp-{i}-{n}", prompt[:200], params, n=n))

    alone = [(await run(i, p))[0][0].prompt_logprobs for i, p in enumerate(prompts)]
    together = await asyncio.gather(*(run(100 + i, p) for i, p in enumerate(prompts)))
    assert (await tight.fresh_stats())["preemptions"] > 0
    for p, a, t in zip(prompts, alone, together):
        got = t[0][0].prompt_logprobs
        assert len(got) == len(p[:200]) and got[0] is None
        assert [e.token_id for e in got[1:]] == list(p[1:200])
        assert [round(e.logprob, 4) for e in got[1:]] == [round(e.logprob, 4) for e in a[1:]]
    two = await run(999, prompts[0], n=2)
    assert two[0][0].prompt_logprobs is not None and two[1][0].prompt_logprobs is None
    tight.close()


async def test_a_prediction_changes_no_greedy_token_and_its_counts_add_up(
        server: LLMServer) -> None:
    """Predicted Outputs: greedy output with a prediction is the output without one, whether
    the prediction is right, an edit of the output, or wrong; every verified prediction token
    is counted as accepted or rejected, and a right one is mostly accepted in few steps."""
    prompt = _prompts(1, seed=21)[0]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    plain = _tokens((await _collect(server, GenerateRequest("pred-plain", prompt, params)))[0])
    edited = plain[:20] + [7, 8, 9] + plain[23:50]
    for name, guess in (("right", plain), ("edited", edited), ("wrong", list(range(50, 90)))):
        steps = (await server.fresh_stats())["num_steps"]
        got = (await _collect(server, GenerateRequest(f"pred-{name}", prompt, params,
                                                      prediction=tuple(guess))))[0]
        steps = (await server.fresh_stats())["num_steps"] - steps
        assert _tokens(got) == plain, name
        accepted = sum(b.accepted_prediction_tokens for b in got)
        rejected = sum(b.rejected_prediction_tokens for b in got)
        if name == "right":
            assert accepted >= 56 and rejected <= 8 and steps < 30, (accepted, rejected, steps)
        if name == "edited":
            assert accepted >= 35, (accepted, rejected)
        if name == "wrong":
            assert accepted <= 4, (accepted, rejected)
    # sampled rows verify by speculative sampling (its distribution: test_prediction.py); a
    # seeded run is repeatable
    warm = SamplingParams(max_tokens=64, temperature=0.01, seed=5, ignore_eos=True)
    runs = [await _collect(server, GenerateRequest(f"pred-sampled-{i}", prompt, warm,
                                                   prediction=tuple(plain))) for i in range(2)]
    assert _tokens(runs[0][0]) == _tokens(runs[1][0]) and len(_tokens(runs[0][0])) == 64
    assert sum(b.accepted_prediction_tokens + b.rejected_prediction_tokens
               for b in runs[0][0]) > 0
    assert (await _settled(server))["num_used_blocks"] == 0


async def test_a_failing_logits_processor_fails_its_request_only(server: LLMServer) -> None:
    """One request's processor raises on its 5th step, another's returns a wrong shape: those
    two fail with a 400 naming the processor; the 15 requests beside them in the same steps
    get exactly what they get alone, and the core keeps serving."""
    prompts = _prompts(16, seed=31)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"rowfail-{i}", p, params) for i, p in enumerate(prompts)]
    alone = [_tokens((await _collect(server, dataclasses.replace(r, request_id=f"alone-{i}"))
                      )[0]) for i, r in enumerate(reqs)]
    bad = [dataclasses.replace(reqs[3], params=dataclasses.replace(
               params, logits_processors=((FAILS, '{"after": 4}'),))),
           dataclasses.replace(reqs[9], params=dataclasses.replace(
               params, logits_processors=((FAILS, '{"after": 2, "wrong_shape": true}'),)))]
    reqs[3], reqs[9] = bad
    results = await asyncio.gather(*(_collect(server, r) for r in reqs), return_exceptions=True)
    for i, (result, expected) in enumerate(zip(results, alone)):
        if i in (3, 9):
            assert isinstance(result, EngineError) and result.status == 400, result
            assert result.param == "logits_processors" and "FailsAfter" in result.message
        else:
            assert not isinstance(result, BaseException), result
            assert _tokens(result[0]) == expected
    assert (await _settled(server))["num_used_blocks"] == 0


async def test_async_scheduling_gives_the_tokens_of_steps_scheduled_one_after_another() -> None:
    """The same mixed load on a core that schedules each step after the last one's result and
    on one that schedules it while that step runs: greedy, seeded top-p, penalties (their rows
    keep the engine scheduling after the result), n = 2, stop tokens, logprobs and lengths up to
    the context limit all give the same tokens, logprobs and finish reasons; the async core did
    schedule steps ahead, and both end with every block free."""
    prompts = _prompts(24, seed=41)
    kinds = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=25, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=1.0, seed=5, logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=1.5,
                            ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(3000, 2000, 1000),
                            ignore_eos=True),
             SamplingParams(max_tokens=128, temperature=1.0, seed=9, ignore_eos=True)]
    reqs = [GenerateRequest(f"mix{i}", p[:100], kinds[i % len(kinds)], n=1 + (i % 5 == 0))
            for i, p in enumerate(prompts)]
    runs = {}
    for mode in (False, True):
        core = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=228,
                                       kv_cache_gib=0.02, max_num_seqs=16,
                                       max_num_batched_tokens=128, block_size=8,
                                       async_scheduling=mode), in_process=True)
        try:
            assert core.info()["async_scheduling"] is mode
            results = await asyncio.gather(*(_collect(core, r) for r in reqs))
            runs[mode] = [{c: ([t for b in bs for t in b.token_ids],
                               [(lp.token_id, round(lp.logprob, 4)) for b in bs
                                for lp in (b.logprobs or ())], bs[-1].finish_reason)
                           for c, bs in out.items()} for out in results]
            stats = await _settled(core)
            assert stats["num_used_blocks"] == 0
            assert (stats["steps_scheduled_ahead"] > 0) is mode
        finally:
            core.close()
    assert runs[True] == runs[False]
    longest = runs[True][5][0]
    assert len(longest[0]) == 128 and longest[2] == "length"


async def test_a_failed_step_with_the_next_one_scheduled_ahead_fails_only_its_requests() -> None:
    """Async scheduling, the engine in this process: the forward raises once, while the step
    after it is queued already with placeholders for the failed step's tokens. The requests of
    those steps fail (the later step cannot take tokens that were never sampled: it fails
    too, not computing on placeholders); nothing hangs, every block comes back, and the next
    requests get exactly the tokens they get on a fresh engine."""
    core = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=256, kv_cache_gib=0.02,
                                   max_num_seqs=8, block_size=8, async_scheduling=True),
                     in_process=True)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = _prompts(6, seed=51)
        expected = [_tokens((await _collect(core, GenerateRequest(f"ok{i}", p, params)))[0])
                    for i, p in enumerate(prompts)]
        executor = core.core.engine.executor  # type: ignore[attr-defined]
        execute, calls = executor.execute, []

        def failing(step):
            calls.append(step)
            if len(calls) == 5:
                raise RuntimeError("this forward fails on purpose")
            return execute(step)

        executor.execute = failing
        results = await asyncio.gather(*(_collect(core, GenerateRequest(f"f{i}", p, params))
                                         for i, p in enumerate(prompts)),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, RuntimeError | EngineError) for r in failed), failed
        assert (await _settled(core))["steps_scheduled_ahead"] > 0
        again = await asyncio.gather(*(_collect(core, GenerateRequest(f"again{i}", p, params))
                                       for i, p in enumerate(prompts)))
        assert [_tokens(a[0]) for a in again] == expected
        assert (await _settled(core))["num_used_blocks"] == 0
    finally:
        core.close()


async def test_a_command_sent_to_a_dead_core_returns_and_a_new_core_serves() -> None:
    """The front's command socket binds, so with its core gone a blocking send waited for a peer
    that never came, holding the replica's event loop and the lock the monitor needs to start
    the next core: a chaos run wedged a replica so, killed between two of the monitor's looks.
    And a core that has gone silent for seconds (frozen) takes no new requests from the routers
    (replicas/router.py) before the monitor's limit has it killed."""
    import signal

    import psutil

    server = LLMServer(ReplicaConfig(model=EMBEDDED_MODEL_ID, max_model_len=128,
                                     kv_cache_gib=0.01, max_num_seqs=2))
    try:
        core = server.core
        pid = (await server.fresh_stats())["core_pid"]
        assert server.engine_up()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(SUSPECT_SILENCE_S + 0.5)
            assert not server.engine_up()
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(2 * HEARTBEAT_S)
        assert server.engine_up()
        why_down = core._why_down  # type: ignore[union-attr]
        # the monitor has not looked yet
        core._why_down = lambda: None  # type: ignore[union-attr]
        psutil.Process(pid).kill()
        psutil.Process(pid).wait(10)
        await asyncio.sleep(0.2)  # the socket has seen its peer go
        sent = asyncio.get_running_loop().time()
        core.abort("nobody")  # flushed on the loop's next turn
        await asyncio.sleep(0)
        assert asyncio.get_running_loop().time() - sent < 1.0
        core._why_down = why_down  # type: ignore[union-attr]
        for _ in range(600):  # a new core, then a request served as before
            if core.failed is None and core.stats()["core_pid"] != pid:  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.1)
        out = await _collect(server, GenerateRequest("after", (5, 6, 7), SamplingParams(
            max_tokens=3, ignore_eos=True)))
        assert len(_tokens(out[0])) == 3
    finally:
        server.close()
