"""Errors raised by the transfer engine."""

from __future__ import annotations


class TransferError(Exception):
    """A transfer or segment operation failed; says which peer and why."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(peer, reason)  # keeps the exception picklable across processes
        self.peer = peer
        self.reason = reason

    def __str__(self) -> str:
        if not self.peer:
            return self.reason
        return f"transfer engine peer {self.peer}: {self.reason}"
