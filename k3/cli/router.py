"""k3 router: an OpenAI-compatible proxy over several k3 serve replicas (cache-aware affinity, failover)."""

from __future__ import annotations

import sys
from urllib.parse import urlparse

from .common import int_at_least, int_in, number

HELP = "route OpenAI requests over several k3 serve replicas by the prefix each one has cached"


def add_arguments(p) -> None:
    p.add_argument("--replicas", required=True,
                   help="comma-separated replica URLs, e.g. http://127.0.0.1:8001,http://127.0.0.1:8002")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int_in(1, 65535), default=8000, help="TCP port")
    p.add_argument("--policy", default="affinity", choices=["affinity", "round-robin", "least-load", "first-block"],
                   help="affinity: the replica holding the longest reusable prefix (MLA pages and a KDA "
                        "checkpoint), else the key's primary on the hash ring (default); first-block: the ring's "
                        "primary for the prompt's first block; round-robin, least-load: cache-blind baselines")
    p.add_argument("--classes", default="short=0:0.75,long=8192:0.25",
                   help="request classes by prompt length, name=min_tokens:share, each with its share of the "
                        "fleet's capacity (default short=0:0.75,long=8192:0.25)")
    p.add_argument("--max-inflight", type=int_at_least(1), default=32,
                   help="requests in flight per healthy replica: the fleet's capacity the classes share (default 32)")
    p.add_argument("--spill", type=number(0), default=4.0,
                   help="spill a request to the key's lighter replica when its choice is this many requests "
                        "busier (queued prompt tokens count 1/2048 each; default 4)")
    p.add_argument("--health-every", type=number(0.05), default=1.0, help="seconds between health checks")
    p.add_argument("--poll-every", type=number(0.05), default=0.25,
                   help="seconds between reads of each replica's prefix-cache state")


def parse_replicas(text: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError("--replicas: give at least one replica URL, e.g. --replicas http://127.0.0.1:8001")
    for u in urls:
        p = urlparse(u)
        if p.scheme not in ("http", "https") or not p.netloc or p.path not in ("", "/"):
            raise ValueError(f"--replicas: {u!r} is not a replica's base URL; write it as http://HOST:PORT "
                             "(without /v1)")
    if len(set(urls)) != len(urls):
        raise ValueError("--replicas: a URL appears twice; name each replica once")
    return urls


def run(args) -> int:
    import uvicorn

    from ..router import Router, create_router_app
    from ..router.admission import parse_classes
    from .serve import bind

    router = Router(parse_replicas(args.replicas), args.policy, parse_classes(args.classes), args.max_inflight,
                    args.spill, health_every=args.health_every, poll_every=args.poll_every)
    sock = bind(args.host, args.port)
    print(f"k3 router: {args.policy} over {len(router.fleet.replicas)} replicas on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_router_app(router), log_level="warning",
                                           timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
