"""Models of real bugs in engines whose code cannot run here (reproduction ``model``).

TensorRT-LLM's KV cache manager is C++/CUDA, LMCache's store runs as its own server
beside an engine: neither can be driven on this machine. Each module here models one
bug's logic and the fixed logic, small enough to read against the engine's source
(each docstring cites the tracker, the fixing change and the lines it models), and
plugs it into an adapter the suite already drives: refserve's engine with the modelled
component swapped in (:mod:`.keyed`), or a self-contained KV manager behind the KV
protocol. A model shows that the suite's rules catch the bug's logic; it is counted
apart from the reproductions on real code (docs/CORPUS.md).
"""
