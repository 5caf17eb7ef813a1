"""The corpus of real bugs: each entry a bug from an engine's public tracker, reproduced on
that engine's own code and caught by the suite, with the fixed code passing (docs/CORPUS.md).

:mod:`~refserve.conformance.corpus.entry` is the record, :mod:`~.catalogue` the entries,
:mod:`~.run` runs them (``refserve conformance --corpus``), :mod:`~.report` writes their
JSON and renders docs/CORPUS.md, and :mod:`~.patches` holds the modules that put a fixed
bug's hunk back into an installed release.
"""
