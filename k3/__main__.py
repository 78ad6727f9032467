"""``python -m k3``: Ctrl-C while the modules import ends with status 130 and one line, not a traceback."""

import sys

try:
    from .cli import entry
except KeyboardInterrupt:
    print("k3: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(entry())
