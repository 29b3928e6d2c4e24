"""What the replica's call-back links share (service.prefill_link: the prefill workers'; service.place_link: the
routers'): a link asks its peer through Ray to connect back to this replica's feed listener, waits for the HELLO
that claims it (service.tcp_feed), and is then one TCP connection carrying calls as numbered frames.

`CallbackLink` holds the link's life: its id and key, the opening (a peer of an older release, without the Ray
method or whose reply does not name the frame kind this replica sends, is remembered and never asked again), the
calls in flight by seq, whether it is usable, and its end. A subclass says how it asks (`_ask`), what its peer's
reply must name (`SENDS`), what an older peer's calls and a closed link's raise, and how a call in flight fails
(`end`). `LinkSet` holds a replica's links to one kind of peer: when a new one is opened (none, or one that ended
REOPEN_S ago) and closing them all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
import uuid
from typing import Generic, TypeVar

from service.tcp_feed import CALLBACK_TIMEOUT_S, CalledBack, FeedListener

log = logging.getLogger(__name__)
REOPEN_S = 5.0  # after a link ended, the next try waits this long (a peer that cannot call back is not asked on
# every request: each try is a Ray call)


class CallbackLink(CalledBack):
    """One connection to one peer (a service.tcp_feed.Link of the listener), opened on creation."""

    NAME = "link"  # what the logs call it
    ID_PREFIX = "l"  # the first letter of the id its HELLO names
    SENDS = ""  # the frame kind the peer's reply must name (else it is an older release)

    def __init__(self, worker_id: str, peer, listener: FeedListener):
        self.worker_id = worker_id  # what the listener's logs name
        self.feed_id = f"{self.ID_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the id its HELLO names
        self.key = secrets.token_urlsafe(24)
        self.ended = False
        self.ended_at = 0.0  # monotonic
        self.older = False  # the peer takes no such link (an older release): never ask it again
        self.calls_sent = 0  # call frames written (tests, benchmarks: how many calls took this path)
        self._listener = listener
        self._conn: asyncio.Transport | None = None
        self._seq = itertools.count()
        self._calls: dict = {}  # seq -> what its caller awaits
        loop = asyncio.get_running_loop()
        self._attached: asyncio.Future = loop.create_future()
        self.opener = loop.create_task(self._open(peer))

    def _method(self, peer):
        """The peer's Ray method that opens such a link, called (link id, host, port, key) -> the frame kinds the peer
        takes; AttributeError when it has none (an older release)."""
        raise NotImplementedError

    def _older(self) -> BaseException:
        """What calls on a peer without the Ray method fail with."""
        raise NotImplementedError

    def _closed(self) -> BaseException:
        """What calls in flight fail with when this replica closes the link."""
        raise NotImplementedError

    def take(self, f: list) -> None:
        """One frame from the peer after its HELLO (FrameError for a kind it does not send: the listener resets it)."""
        raise NotImplementedError

    def _took(self, takes) -> None:
        """The peer's reply named SENDS: note what else it names (a subclass that cares)."""

    def end(self, error: BaseException) -> None:
        """The connection is gone (or never came): the subclass fails every call in flight (`_ended` first)."""
        raise NotImplementedError

    def _ended(self) -> dict:
        """Mark the link ended -> the calls that were in flight (now taken off it)."""
        if not self.ended:
            self.ended, self.ended_at = True, time.monotonic()
        calls, self._calls = self._calls, {}
        return calls

    async def _open(self, peer) -> None:
        """Ask the peer to call back, then wait for its HELLO; any failure ends the link (calls keep the fallback)."""
        listener = self._listener
        try:
            try:
                method = self._method(peer)
            except AttributeError:  # a peer of a release before links
                self.older = True
                return self.end(self._older())
            await listener.start()  # the first time only (later calls return at once)
            listener.expect(self)
            takes = await method.remote(self.feed_id, listener.host, listener.port, self.key)
            if not (isinstance(takes, (tuple, list)) and self.SENDS in takes):
                self.older = True
                return self.close()
            self._took(takes)
            await asyncio.wait_for(asyncio.shield(self._attached), CALLBACK_TIMEOUT_S)
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception as e:  # noqa: BLE001 - any (a dead actor, no call back in time): the fallback stays the path
            log.info("%s to %s did not open: %r", self.NAME, self.worker_id, e)
            self.close()

    def usable(self) -> bool:
        conn = self._conn
        return not self.ended and conn is not None and not conn.is_closing()

    def close(self) -> None:
        self._listener.forget(self)
        if self.opener is not asyncio.current_task():
            self.opener.cancel()
        if self._conn is not None:
            self._conn.close()  # the peer sees the close and drops the calls still running
        self.end(self._closed())


Link = TypeVar("Link", bound=CallbackLink)


class LinkSet(Generic[Link]):
    """A replica's links to one kind of peer, by a key the caller names; create inside the loop that reads them."""

    def __init__(self, listener: FeedListener):
        self.listener = listener
        self._links: dict = {}

    def _current(self, key) -> Link | None:
        """The link under `key` unless none was opened or it ended REOPEN_S ago (a peer that took none stays)."""
        link = self._links.get(key)
        if link is not None and link.ended and not link.older and time.monotonic() - link.ended_at >= REOPEN_S:
            return None
        return link

    def calls_sent(self) -> int:
        """Call frames written on the links open now (tests, benchmarks)."""
        return sum(link.calls_sent for link in self._links.values())

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        await asyncio.gather(*(link.opener for link in links), return_exceptions=True)
