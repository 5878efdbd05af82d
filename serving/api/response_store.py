"""The Responses API's store: responses kept in memory for `previous_response_id`,
`GET /v1/responses/{id}`, background runs and their cancellation (`serving/api/responses_routes.py`).

A `StoredResponse` holds the response object as a client sees it, the input items of its own
request (what `GET /v1/responses/{id}/input_items` lists) and its **context**: every item the model
saw before its output (the previous response's context and output, then this request's input;
`instructions` are a request's own and never carried over, as OpenAI's API does). The next turn
of a conversation (`previous_response_id`) is that context, this response's output, and the new
input. Contexts share their items with the responses they came from (lists of the same dicts),
so a chain of N turns holds each item once and N lists of references.

Bounded two ways (least recently used first out; a background response still running is never
evicted): `max_entries` responses, and `max_bytes` counted as each entry's context and output as
JSON and a background stream's kept events as sent (a chain's shared items are counted in every
entry that holds them, so the bound is an upper bound on what the store keeps alive). Events of a background stream are kept until the entry
goes, so a client can resume the stream (`GET ...?stream=true&starting_after=N`).

Everything here runs on the server's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def json_bytes(obj: Any) -> int:
    """The size of `obj` as compact JSON, in bytes (what the store counts)."""
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode())


@dataclass
class StoredResponse:
    """One stored response (see the module docstring). `response` is replaced as it changes;
    `events` are `(sequence_number, SSE text)` of a background stream, in order."""

    id: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]
    context_bytes: int = 0
    output_bytes: int = 0
    events_bytes: int = 0
    background: bool = False
    stream: bool = False
    task: asyncio.Task | None = None
    events: list[tuple[int, str]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    @property
    def nbytes(self) -> int:
        return self.context_bytes + self.output_bytes + self.events_bytes

    def next_context(self) -> list[dict[str, Any]]:
        """What a request naming this response as `previous_response_id` continues: the context
        and this response's output items."""
        return [*self.context, *(self.response.get("output") or [])]

    def add_event(self, seq: int, text: str) -> None:
        self.events.append((seq, text))
        self.events_bytes += len(text.encode())
        self._notify()

    def update(self, response: dict[str, Any]) -> None:
        self.response = response
        self.output_bytes = json_bytes(response.get("output") or [])
        self._notify()

    async def cancel(self) -> None:
        """End an unfinished response as `cancelled`: its background run (if any) is cancelled and
        awaited (the chat path aborts its engine request). A finished one is left as it is."""
        if self.finished:
            return
        self.update({**self.response, "status": "cancelled"})
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[str]:
        """The stream's events after sequence number `starting_after`, then each new one as it is
        recorded, until the response has finished (or its run ended without a last event)."""
        sent = starting_after
        while True:
            changed = self._changed
            for seq, text in self.events:
                if seq > sent:
                    sent = seq
                    yield text
            if self.finished or (self.task is not None and self.task.done()):
                # an event recorded between the loop and here is sent before stopping
                if not any(seq > sent for seq, _ in self.events):
                    return
                continue
            await changed.wait()


class ResponseStore:
    """Stored responses by id, least recently used first out (see the module docstring).

    max_entries: responses kept at most (at least 1).
    max_bytes: the entries' context and output, as JSON, at most (at least 1); one entry larger
        than that is still kept until the next one comes.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"a response store needs room (max_entries={max_entries}, max_bytes={max_bytes})")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when unknown (never stored, evicted or deleted)."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) `entry` as the most recently used, then evict what exceeds the bounds."""
        self._entries[entry.id] = entry
        self._entries.move_to_end(entry.id)
        self.evict()

    def delete(self, response_id: str) -> StoredResponse | None:
        return self._entries.pop(response_id, None)

    def evict(self) -> None:
        """Drop finished entries, least recently used first, while over a bound; the newest entry
        stays (and running background responses, which are not counted out)."""
        total = sum(e.nbytes for e in self._entries.values())
        for rid in list(self._entries)[:-1]:
            if len(self._entries) <= self.max_entries and total <= self.max_bytes:
                return
            entry = self._entries[rid]
            if not entry.finished:
                continue
            total -= entry.nbytes
            del self._entries[rid]
            self.evicted += 1
