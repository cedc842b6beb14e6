"""Stored responses for `previous_response_id`, `GET /v1/responses/{id}` and
`DELETE /v1/responses/{id}`: a bounded in-memory LRU (--responses-store-size); the least
recently used response goes first, and an evicted, deleted or unknown id is a 404 naming
it. Used on the event loop only."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from slipstream.server.errors import APIError


@dataclass
class StoredResponse:
    response: dict  # the response object as sent
    messages: list[dict]  # the conversation through this response's output, as chat messages


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        rid = stored.response["id"]
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None:
            raise _missing(response_id, param)
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        if self._items.pop(response_id, None) is None:
            raise _missing(response_id, None)


def _missing(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r} (it was never stored, "
                         "was deleted, or the server's --responses-store-size evicted it)", param)
