"""A stand-in for a gRPC servicer context, shared by the unit tests of the servicers.

Not a test module. It records what a servicer sets (status code, details, trailing metadata) and
returns the invocation metadata it was built with, as Ray Serve's gRPC proxy context does.
"""

from __future__ import annotations


class RecordingContext:
    """Records ``set_code`` / ``set_details`` / ``set_trailing_metadata``; serves ``invocation_metadata``.

    Args:
        metadata: the request's metadata as ``(key, value)`` pairs.
    """

    def __init__(self, metadata=()):
        self.md = tuple(metadata)
        self.code = None
        self.details = None
        self.trailing = ()

    def invocation_metadata(self):
        return self.md

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, md):
        # as Ray Serve's RayServegRPCContext.set_trailing_metadata: its request-id pairs (a list)
        # + md, so anything but a list raises TypeError there and here
        self.trailing = tuple([] + md)
