"""The OpenAI-compatible HTTP server over the engine (``refserve serve``) and the
HTTP load generator (``refserve bench-serve``). Above ``refserve.engine``, below
``refserve.cli``."""
