"""Mutation testing's results and docs/MUTATION.md (rendered, never typed).

:mod:`~refserve.conformance.mutation.results` is the JSON of one run (scope, selection,
counts per file, every survivor with its verdict) and its reading of mutmut's own
results under ``mutants/``; :mod:`~.run` drives mutmut (every mutant, or a uniform
sample) and writes that JSON into docs/mutation/; :mod:`~.report` renders
docs/MUTATION.md from the committed JSON, and ``tests/repo/test_mutation_doc.py``
requires the two to agree, like docs/BENCHMARKS.md.
"""
