"""The ``refserve`` command line: the only layer that may import ``conformance`` (for the
``conformance`` and ``check-kernel`` subcommands)."""
