"""Endpoints that come back: an actor that serves HTTP clients serves from its
constructor, so that when Ray restarts it (after its process died) it listens again at
once, on the same host and port.

An endpoint actor is pinned to the node that started it (the driver's: clients were
told that host), restarts without limit, and serves from a thread with an event loop of
its own: Ray runs an actor's constructor before any of its methods, and an actor
restarted by Ray gets no call but its constructor. What a client posted and was
answered for must survive the actor (a ledger, a keyed store append): that is each
endpoint's own business.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import ray
from aiohttp import web
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlray.cluster.calls import ActorRestarted

Item = TypeVar("Item")
Result = TypeVar("Result")


class EndpointUnavailable(Exception):
    """An actor the endpoint needs is dead or restarting: its client is answered 503
    with Retry-After, and retries."""


def free_port(host: str) -> int:
    """Returns a TCP port of `host` (an address of this node) that was free a moment ago:
    an endpoint asked for port 0 gets one for good, to listen on again when restarted."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def endpoint_options(name: str, max_concurrency: int = 64) -> dict[str, Any]:
    """Returns the Ray options of an endpoint actor called `name`: no CPU reserved,
    restarted whenever it dies, on this (the caller's) node."""
    here = ray.get_runtime_context().get_node_id()
    return {
        "name": name,
        "num_cpus": 0,
        "max_concurrency": max_concurrency,
        "max_restarts": -1,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False),
    }


class ThreadedServer:
    """Serves an aiohttp application at host:port from a daemon thread with its own
    event loop; listening when the constructor returns (raises OSError if it cannot)."""

    def __init__(self, app: web.Application, host: str, port: int, timeout_s: float = 30.0):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="http", daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app, access_log=None)
        started = asyncio.run_coroutine_threadsafe(self._serve(host, port), self.loop)
        self.host, self.port = host, started.result(timeout=timeout_s)

    async def _serve(self, host: str, port: int) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # the port bound, when 0 was asked

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)


async def remote_result(ref: Any) -> Any:
    """Returns the value of an actor call, awaited in any event loop; raises
    EndpointUnavailable if the actor died, is restarting, or is not yet restored."""
    try:
        return await asyncio.wrap_future(ref.future())
    except RayActorError as err:
        raise EndpointUnavailable(
            f"an actor of the run is restarting ({type(err).__name__})"
        ) from None
    except RayTaskError as err:
        if isinstance(err.cause, (ActorRestarted, RayActorError)):
            raise EndpointUnavailable("an actor of the run is restarting") from None
        raise


class JoinedCalls(Generic[Item, Result]):
    """Joins the calls that reach an event loop's turn together into one remote call per
    key: `call(key, item)` queues the item and waits for its own result, and the items
    of one key queued before the loop's next turn go out as `send(key, items)` (a result
    per item, in order). A remote call's fixed cost (Ray's submission, the actor's
    thread, the reply) is then paid once for all of them, not once each. Nothing waits
    for more items than have come: a lone call goes out at the next turn."""

    def __init__(self, send: Callable[[int, list[Item]], Awaitable[list[Result]]]):
        self.send = send
        self.queued: dict[int, list[tuple[Item, asyncio.Future]]] = {}
        self.sending: set[asyncio.Task] = set()  # a task is only weakly held by its loop
        self.calls = 0
        self.sent = 0
        """Calls made, and remote calls that carried them."""

    async def call(self, key: int, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if key not in self.queued:
            self.queued[key] = []
            loop.call_soon(self._send_queued, key)
        self.queued[key].append((item, future))
        self.calls += 1
        return await future

    def _send_queued(self, key: int) -> None:
        queued = self.queued.pop(key)
        self.sent += 1
        task = asyncio.ensure_future(self._send(key, queued))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send(self, key: int, queued: list[tuple[Item, asyncio.Future]]) -> None:
        try:
            results = await self.send(key, [item for item, _ in queued])
            if len(results) != len(queued):
                raise RuntimeError(
                    f"the remote call answered {len(results)} results for {len(queued)} calls"
                )
        except Exception as err:  # every caller of the batch hears it
            for _, future in queued:
                if not future.done():  # a caller gone (its client hung up) is cancelled
                    future.set_exception(err)
            return
        for (_, future), result in zip(queued, results, strict=True):
            if not future.done():
                future.set_result(result)
