"""OpenAI-compatible HTTP serving of a k3 inference engine: ``create_app``, ``run_server``, ``ChatTemplate``.

Files: app.py (routes, validation, run_server), protocol.py (request bodies, error bodies), format.py (response
bodies and stream chunks), stream.py (engine thread -> asyncio bridge, cancel on disconnect), chat.py (the
chat template).
"""

from .app import create_app, run_server
from .chat import ChatTemplate

__all__ = ["create_app", "run_server", "ChatTemplate"]
