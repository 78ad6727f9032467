"""Unknown config.json fields: refused by default, naming the file and the field, with the ways to keep them.

A field k3 has no setting for would be ignored, and a typo (``num_hiden_layers``) would silently build another
model, so ``K3Config.from_hf`` refuses it. ``K3_CONFIG_UNKNOWN=keep`` in the environment (every k3 command) or
``strict=False`` (Python) carries such fields through unread: they are written back when the config is saved.
"""

from __future__ import annotations

import os
from pathlib import Path

KEEP_UNKNOWN_ENV = "K3_CONFIG_UNKNOWN"


class UnknownConfigField(ValueError):
    """A config.json field k3 has no setting for."""

    def at(self, src) -> "UnknownConfigField":
        """This error with the file it came from and what to do."""
        where = "the config" if isinstance(src, dict) else \
            str(Path(src) / "config.json" if Path(src).is_dir() else Path(src))
        return UnknownConfigField(
            f"{where}: {self}: k3 has no setting of that name, so it would be ignored. Remove it from the file if it "
            "is a typo or another model's setting; to keep it unread (written back when k3 saves the config), run "
            f"with {KEEP_UNKNOWN_ENV}=keep in the environment (in Python: K3Config.from_hf(..., strict=False))")


def strict_reading(strict: bool) -> bool:
    """Whether unknown fields are refused: ``strict``, unless the environment says keep."""
    keep = os.environ.get(KEEP_UNKNOWN_ENV)
    if keep not in (None, "", "keep"):
        raise ValueError(f"{KEEP_UNKNOWN_ENV}={keep!r}: the only value is 'keep' (carry unknown config.json fields "
                         "through unread); unset it to refuse them")
    return strict and keep != "keep"
