"""Test-session set-up shared by ``lightning_ext`` doctests, ``tests`` and the notebooks.

Without a GPU, Triton's kernels run on CPU tensors in Triton's interpreter, which
``TRITON_INTERPRET=1`` selects; it must be set before anything imports ``triton``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
