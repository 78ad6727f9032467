"""OpenAI-compatible HTTP serving of a k3 inference engine: ``create_app``, ``run_server``.

Files: app.py (routes, validation, run_server), protocol.py (request bodies, error bodies), format.py (response
bodies and stream chunks), stream.py (engine thread -> asyncio bridge, cancel on disconnect), images.py (chat
prompts with images). The chat formats themselves are k3.chat's.
"""

__all__ = ["create_app", "run_server"]


def __getattr__(name: str):
    """The HTTP app (fastapi, uvicorn) is imported on first use, so k3.serve.images imports where they are not
    installed (``k3 chat`` on a machine with torch alone)."""
    if name in ("create_app", "run_server"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
