"""Request metadata keys of the serving layer, shared by the gRPC and HTTP ingress and the client.

The HTTP API maps its headers onto these gRPC metadata keys
(:func:`deployments.openai_requests.metadata_from_headers`). No Ray or gRPC import here: the client
library uses them too.
"""

#: Metadata key carrying the client's deadline as seconds from now (the client library sets it).
TIMEOUT_KEY = "specdec-timeout-s"
#: Metadata key of the session (Serve's own key: also drives sticky routing in the proxy).
SESSION_KEY = "session_id"
#: Metadata key naming the Serve application (Serve's gRPC proxy routes on it).
APPLICATION_KEY = "application"
#: Longest session id accepted (characters): it is a routing key and part of every draft and
#: target session's key, so an unbounded one is memory and log lines an attacker chooses.
MAX_SESSION_ID_CHARS = 256
