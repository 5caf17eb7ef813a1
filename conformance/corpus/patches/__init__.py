"""Patch modules: each puts one fixed bug's hunk back into an installed engine, on the
objects its own factory builds only (a subclass or an instance's method), never on a
module or a class the clean adapter shares, so the buggy and the clean side run in one
process. Each docstring cites the tracker, the fixing change and the hunk, and says how
the re-applied code was checked against the tracker's description.
"""
