"""A place in the user's code: what errors, overflow reports and pins point at."""

from __future__ import annotations

import linecache
import os
from dataclasses import dataclass

__all__ = ["SOURCE_LINE_META", "UserFrame"]

# the node metadata that says where in the user's files a node was traced: provenance for
# messages and reports, never part of what the node computes
SOURCE_LINE_META = ("stack_trace", "user_frame")


@dataclass(frozen=True)
class UserFrame:
    """Where in the user's code (not torch, not graphamp) something happened."""

    filename: str
    lineno: int
    function: str

    @property
    def code(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def short(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    def __str__(self) -> str:
        code = self.code
        return f"{self.filename}:{self.lineno} in {self.function}" + (f": {code}" if code else "")
