"""JoinedCalls (rlray.cluster.serving): the calls that reach an event loop's turn
together go out as one remote call per key, each caller gets its own result, and a
lone call waits for nobody."""

from __future__ import annotations

import asyncio

from rlray.cluster.serving import JoinedCalls


class Remote:
    """Records what each send carried; answers each item doubled, or raises."""

    def __init__(self, error: Exception | None = None):
        self.sends: list[tuple[int, list[int]]] = []
        self.error = error
        self.release = asyncio.Event()
        self.release.set()

    async def send(self, key: int, items: list[int]) -> list[int]:
        self.sends.append((key, list(items)))
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return [2 * item for item in items]


def test_calls_made_together_go_out_as_one_send_per_key_in_order():
    async def main():
        remote = Remote()
        joined = JoinedCalls(remote.send)
        results = await asyncio.gather(*(joined.call(i % 2, i) for i in range(6)))
        return remote.sends, results, (joined.calls, joined.sent)

    sends, results, counts = asyncio.run(main())
    assert sends == [(0, [0, 2, 4]), (1, [1, 3, 5])]
    assert results == [0, 2, 4, 6, 8, 10]
    assert counts == (6, 2)


def test_a_lone_call_goes_out_at_once_and_later_calls_in_a_send_of_their_own():
    async def main():
        remote = Remote()
        joined = JoinedCalls(remote.send)
        first = await asyncio.wait_for(joined.call(0, 7), timeout=5)
        second = await asyncio.wait_for(joined.call(0, 8), timeout=5)
        return remote.sends, first, second

    sends, first, second = asyncio.run(main())
    assert sends == [(0, [7]), (0, [8])]
    assert (first, second) == (14, 16)


def test_calls_arriving_while_a_send_runs_make_the_next_send():
    async def main():
        remote = Remote()
        remote.release.clear()
        joined = JoinedCalls(remote.send)
        early = [asyncio.ensure_future(joined.call(0, i)) for i in range(2)]
        await asyncio.sleep(0.01)  # the first send is out and waiting
        late = [asyncio.ensure_future(joined.call(0, i)) for i in range(2, 5)]
        await asyncio.sleep(0.01)
        remote.release.set()
        return remote.sends, await asyncio.gather(*early, *late)

    sends, results = asyncio.run(main())
    assert sends == [(0, [0, 1]), (0, [2, 3, 4])]
    assert results == [0, 2, 4, 6, 8]


def test_a_failed_send_reaches_every_caller_of_it_and_a_cancelled_caller_no_one_else():
    async def main():
        remote = Remote(error=RuntimeError("the actor is restarting"))
        remote.release.clear()
        joined = JoinedCalls(remote.send)
        calls = [asyncio.ensure_future(joined.call(0, i)) for i in range(3)]
        await asyncio.sleep(0.01)
        calls[0].cancel()  # its client hung up
        remote.release.set()
        return await asyncio.gather(*calls, return_exceptions=True)

    cancelled, *failed = asyncio.run(main())
    assert isinstance(cancelled, asyncio.CancelledError)
    assert [str(err) for err in failed] == ["the actor is restarting"] * 2


def test_a_send_that_answers_too_few_results_fails_its_callers():
    async def short(key: int, items: list[int]) -> list[int]:
        return items[:1]

    async def main():
        joined = JoinedCalls(short)
        return await asyncio.gather(*(joined.call(0, i) for i in range(2)), return_exceptions=True)

    results = asyncio.run(main())
    assert [str(r) for r in results] == ["the remote call answered 1 results for 2 calls"] * 2
