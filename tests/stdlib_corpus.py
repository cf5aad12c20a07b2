"""The Python standard library corpus as Python 3.11.7 has it (``stdlib_doc_lengths()`` there), for tests.

``megatron_hsap.sequence.doc_lengths.stdlib_doc_lengths`` reads the running interpreter's standard library, so
another Python (3.12 in ``make test-latest``) packs other batches; tests whose checked facts belong to
particular batches (a 105K-token file at one offset, the four hard 1M-token batches) read these frozen sizes.
"""

from __future__ import annotations

import os
from typing import List

_SIZES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stdlib_3_11_doc_lengths.txt")


def stdlib_3_11_doc_lengths() -> List[int]:
    """Sizes in bytes of Python 3.11.7's standard library source files, in ``stdlib_doc_lengths()``'s order."""
    with open(_SIZES) as f:
        return [int(x) for x in f.read().split()]
