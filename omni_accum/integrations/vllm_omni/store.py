"""Upstream's accumulator dict as the store of record: removing an entry releases omni-accum's state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ReleasingDict(dict):
    """The transport's ``_send_side_request_payload``: removing an entry releases the Receiver state.

    Upstream releases its accumulator by popping this dict (chunk finished, cleanup, abort), so the
    Receiver is released exactly there, whatever the path.
    """

    def __init__(self, release: Callable[[Any], Any], *args: Any) -> None:
        super().__init__(*args)
        self.release = release

    def pop(self, key: Any, *default: Any) -> Any:
        self.release(key)
        return super().pop(key, *default)

    def __delitem__(self, key: Any) -> None:
        self.release(key)
        super().__delitem__(key)

    def popitem(self) -> tuple[Any, Any]:
        key, value = super().popitem()
        self.release(key)
        return key, value

    def clear(self) -> None:
        for key in list(self):
            self.release(key)
        super().clear()
