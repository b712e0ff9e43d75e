"""What every view shares: a model drawn as text and HTML (and rich, where it has a `__rich__`).

Views are plain objects; how one is shown (a widget in a kernel, rich in a terminal, the
MIME bundle elsewhere), and which widget shows which view, is decided in `display`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class TextHtmlView(ABC):
    """A view with a text and an HTML rendering of one model."""

    @abstractmethod
    def text(self) -> str:
        """The view as plain text."""

    @abstractmethod
    def html(self) -> str:
        """The view as HTML."""

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.html()}

    def __repr__(self) -> str:
        return self.text()
