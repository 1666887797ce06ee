"""Imported first by the CLI and the stage fork server: silences third-party import noise that
says nothing about the user's run.

With the dev extra installed, transformers imports torchao, which warns on a CPU machine that its
CUDA extensions cannot load, and torch then warns about torchao's enum registrations: five lines
at every start of `posttrain` and of every stage. Errors from both still show.
"""

import logging

for name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(name).setLevel(logging.ERROR)
