"""specdec: exact speculative decoding (draft/target and prompt lookup) with per-tenant K.

The core package imports neither Ray nor gRPC.
"""

__version__ = "0.1.0"
