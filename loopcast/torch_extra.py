"""torch is an optional extra (``pip install -e '.[torch]'``): export and run need none.

The torch reference backend, random checkpoints, training tools and bench's PyTorch baselines
import it through :func:`require_torch`, so a missing install is one line naming the extra.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from loopcast.errors import LoopcastError

EXTRA_HINT = "pip install 'loopcast[torch]' (or -e '.[torch]' in a checkout)"


def require_torch(what: str) -> ModuleType:
    """The ``torch`` module, or a LoopcastError saying that ``what`` needs the [torch] extra."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise LoopcastError(f"{what} needs PyTorch, which is not installed: {EXTRA_HINT}") from None
