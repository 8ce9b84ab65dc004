"""Stored Responses API responses (protocols/responses.py): in memory, under a byte bound,
the least recently used dropped first."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from . import RequestError

STORE_BYTES = 64 << 20  # what stored responses may hold together, by default


class ResponseStore:
    """Stored responses and the conversations they end, in memory, under ``max_bytes``
    (their JSON's size), the least recently used dropped first."""

    def __init__(self, max_bytes: int = STORE_BYTES):
        self.max_bytes, self.bytes = max_bytes, 0
        self._held: "OrderedDict[str, Tuple[Dict[str, Any], List[Dict[str, Any]], int]]" = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: Dict[str, Any], conversation: List[Dict[str, Any]]) -> bool:
        """Store ``response``; False: it alone is larger than the bound, so it is not kept
        (and nothing else is dropped for it)."""
        size = len(json.dumps([response, conversation]))
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            self._held[response["id"]] = (response, conversation, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._held)))
        return True

    def get(self, response_id: str) -> Optional[Tuple[Dict[str, Any], List[Dict[str, Any]]]]:
        with self._lock:
            if response_id not in self._held:
                return None
            self._held.move_to_end(response_id)
            response, conversation, _ = self._held[response_id]
            return response, conversation

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        held = self._held.pop(response_id, None)
        if held is not None:
            self.bytes -= held[2]
        return held is not None

    def __len__(self) -> int:
        return len(self._held)


def not_found(response_id: str, param: Optional[str] = None) -> RequestError:
    return RequestError(404, f"no response with id {response_id!r} is stored here (it was never stored, was deleted, "
                             "or was dropped to keep the store under its byte bound)", param, "response_not_found")
