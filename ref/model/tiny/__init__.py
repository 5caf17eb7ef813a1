"""The embedded trained model ``"tiny-trained"``: a small byte-level Llama and its corpus.

The checkpoint (``config.json`` + ``model.safetensors``) in this directory is written by
``make train-tiny`` (:mod:`refserve.model.train_tiny`) from the sentences that
:mod:`refserve.model.tiny.corpus` generates; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

#: The checkpoint directory that ``LLMEngine("tiny-trained")`` loads.
TRAINED_DIR = Path(__file__).resolve().parent
