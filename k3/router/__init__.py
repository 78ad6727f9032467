"""Fleet routing (SPEC §7): ``k3 router``, an OpenAI-compatible proxy in front of several ``k3 serve`` replicas.

Files: proxy.py (the HTTP app, forwarding, failover), policy.py (affinity over consistent hashing, spill, the
baselines), index.py (the mirror of each replica's KDA-aware prefix cache), admission.py (per-class shares of the
fleet), fleet.py (health checks, prefix-state polling). The replicas' side is k3.serve.fleet. See docs/router.md.
"""

__all__ = ["Router", "create_router_app"]


def __getattr__(name: str):
    """The HTTP pieces (fastapi, aiohttp, uhashring) are imported on first use."""
    if name in ("Router", "create_router_app"):
        from . import proxy

        return getattr(proxy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
