"""The worker's wall-time engine in process: scheduling, load, and failure containment."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest
import zmq

from events.stream.publisher import ZmqEventPublisher
from kvcache.scope import ReuseScope
from router_sim.service.engine import LiveEngine, LiveRequest, RequestTooLarge
from router_sim.sim.timing import ConstantStepTiming

pytestmark = pytest.mark.timeout(30)
_names = itertools.count()


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ZmqEventPublisher(f"inproc://engine-test-{next(_names)}", context=ctx)
    try:
        yield pub
    finally:
        pub.close(timeout_s=1.0)
        ctx.term()


class FailingOnce:
    """A step timing that raises on its first call: a bug inside a step."""

    def __init__(self) -> None:
        self.calls = 0

    def step_ms(self, prefill_tokens: int, decode_requests: int, kv_usage: float) -> float:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("boom")
        return 0.0


def engine(publisher: ZmqEventPublisher, timing: object, blocks: int = 16) -> LiveEngine:
    return LiveEngine(
        tokens_per_block=4,
        device_blocks=blocks,
        timing=timing,  # type: ignore[arg-type]
        publisher=publisher,
        max_batch_tokens=8,
    )


async def answer(r: LiveRequest) -> list[int]:
    out = []
    while (t := await r.tokens.get()) is not None:
        out.append(t)
    return out


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(
    publisher: ZmqEventPublisher,
) -> None:
    async def scenario() -> None:
        e = engine(publisher, FailingOnce())
        task = asyncio.create_task(e.run())
        first = LiveRequest(list(range(10)), 3, ReuseScope())
        e.submit(first)
        assert await asyncio.wait_for(answer(first), 5) == []
        assert first.error == "RuntimeError: boom" and first.finished
        second = LiveRequest(list(range(10)), 3, ReuseScope())
        e.submit(second)
        assert len(await asyncio.wait_for(answer(second), 5)) == 3
        assert second.error is None
        assert e.manager.kv_usage(0) == 0.0  # both released their pages
        task.cancel()

    asyncio.run(scenario())


def test_load_counts_queued_prompts_and_requests(publisher: ZmqEventPublisher) -> None:
    e = engine(publisher, ConstantStepTiming())
    e.submit(LiveRequest(list(range(10)), 2, ReuseScope()))
    e.submit(LiveRequest(list(range(7)), 2, ReuseScope()))
    load = e.load()
    assert load.active_requests == 2
    assert load.pending_prefill_tokens == 17
    assert load.decode_blocks == 0


def test_a_request_that_can_never_fit_is_refused(publisher: ZmqEventPublisher) -> None:
    e = engine(publisher, ConstantStepTiming(), blocks=4)  # 16 tokens
    with pytest.raises(RequestTooLarge, match="need 5 KV blocks"):
        e.submit(LiveRequest(list(range(15)), 2, ReuseScope()))
    e.submit(LiveRequest(list(range(14)), 2, ReuseScope()))  # exactly 16: fits


def test_chunked_prefill_then_one_token_per_step(publisher: ZmqEventPublisher) -> None:
    """max_batch_tokens 8: a 10-token prompt takes two steps (8 + 2 tokens); the second
    completes the prompt and yields the first token; each later step yields one more."""
    steps: list[tuple[int, int]] = []

    class Recording:
        def step_ms(self, prefill_tokens: int, decode_requests: int, kv_usage: float) -> float:
            steps.append((prefill_tokens, decode_requests))
            return 0.0

    async def scenario() -> None:
        e = engine(publisher, Recording())
        task = asyncio.create_task(e.run())
        r = LiveRequest(list(range(10)), 3, ReuseScope())
        e.submit(r)
        assert len(await asyncio.wait_for(answer(r), 5)) == 3
        task.cancel()

    asyncio.run(scenario())
    assert steps == [(8, 0), (2, 0), (0, 1), (0, 1)]


def test_snapshot_is_what_the_published_batches_add_up_to(publisher: ZmqEventPublisher) -> None:
    """The worker's snapshot provider: after a request the cache holds the prompt's full
    blocks (10 tokens + 2 generated, 4 per block: blocks [0:4], [4:8], [8:12]), and the
    snapshot names exactly the hashes its published Stored events announced."""
    announced: list[int | str] = []
    real_publish = publisher.publish

    def recording(events, ts=None):  # type: ignore[no-untyped-def]
        for ev in events:
            announced.extend(b.block_hash for b in getattr(ev.data, "blocks", []))
        return real_publish(events, ts)

    publisher.publish = recording  # type: ignore[method-assign]

    async def scenario() -> None:
        e = engine(publisher, ConstantStepTiming())
        task = asyncio.create_task(e.run())
        r = LiveRequest(list(range(10)), 3, ReuseScope())
        e.submit(r)
        await asyncio.wait_for(answer(r), 5)
        task.cancel()
        snap = e.snapshot()
        assert snap is not None
        hashes = [b.block_hash for ev in snap for b in getattr(ev.data, "blocks", [])]
        assert len(hashes) == 3 and sorted(map(str, hashes)) == sorted(map(str, announced))

    asyncio.run(scenario())
