"""The model side: a Llama-architecture decoder over the paged KV cache, its sampler and
tokenizer, and the executor that runs it for the core's step.

- :mod:`refserve.model.config`: :class:`ModelConfig` (from a Hugging Face ``config.json``, or the
  built-in tiny one);
- :mod:`refserve.model.weights`: seeded random weights and the local checkpoint loader;
- :mod:`refserve.model.attention`: the attention backends (``torch`` and ``triton``);
- :mod:`refserve.model.llama`: the forward pass over one step's flattened tokens;
- :mod:`refserve.model.tiny`: the embedded trained checkpoint ``"tiny-trained"`` and its corpus,
  written by :mod:`refserve.model.train_tiny` (``make train-tiny``);
- :mod:`refserve.model.sampler`, :mod:`refserve.model.tokenizer`;
- :mod:`refserve.model.rejection` and :mod:`refserve.model.proposers`: speculative decoding's
  verification (greedy matching, rejection sampling) and its draft proposers (n-gram
  lookup, a draft model), docs/SPECULATIVE.md;
- :mod:`refserve.model.executor`: :class:`ModelExecutor`, the core's executor protocol over the
  model.

Nothing is imported here, so the tokenizer does not pay for torch.
"""
