"""What a rank sends back in place of a cell's value that cannot be pickled: it shows what it was."""

from __future__ import annotations

from typing import Any


class UnpicklableValue:
    """Stands in for a cell value that could not be sent back; shows what it was."""

    def __init__(self, type_name: str, text: str, error: str, rank: int):
        self.type_name, self.text, self.error, self.rank = type_name, text, error, rank

    def __repr__(self) -> str:
        return (f"<unpicklable {self.type_name} on rank {self.rank}: {self.text} "
                f"({self.error}); keep it on the ranks, or return something picklable>")


def stand_in_for(value: Any, error: str, rank: int, limit: int = 200) -> UnpicklableValue:
    """The stand-in for `value`, which could not be pickled (`error`), with its repr cut to `limit`."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<repr failed: {exc}>"
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return UnpicklableValue(type(value).__name__, text, error, rank)
