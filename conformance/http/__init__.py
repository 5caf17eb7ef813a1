"""Black-box conformance of an OpenAI-compatible HTTP server (``refserve
conformance-http``): the server's answers against refserve's engine on the same
checkpoint. Only HTTP reaches the server; a server that hangs, answers garbage or closes
the connection gives findings, never a hang or a traceback of the tool."""
