"""specdec's Ray Serve application: translation (protos <-> core types), placement and I/O only.

The core (``specdec``) never imports Ray or gRPC; everything here is thin glue around it.
"""
