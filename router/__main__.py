"""`python -m router`: serve the router over in-process engines (the colocated single-engine mode).

The Ray deployment builds `RouterServer` with its own dispatcher instead; this entry point is for a
single machine and for trying the API (`--workers 1` is one engine doing prefill and decode).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging

from router.policy import POLICIES, PolicyConfig, RoutingPolicy


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--workers", type=int, default=1, help="in-process engines (each prefill + decode)")
    p.add_argument("--model-dir", default=None, help="default: the built-in tiny model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds between health probes")
    p.add_argument("--max-inflight", type=int, default=0, help="0 = unlimited")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from engine.loading.load import load_engine
    from router.local_dispatch import LocalDispatcher
    from router.server import RouterServer

    dispatcher = LocalDispatcher(args.workers, functools.partial(load_engine, args.model_dir, args.device, warmup=True))
    server = RouterServer(
        dispatcher,
        RoutingPolicy(PolicyConfig(args.policy)),
        health_interval_s=args.health_interval,
        max_inflight=args.max_inflight,
    )
    port = await server.start(args.host, args.port)
    print(f"router serving {args.workers} engine(s) on {args.host}:{port}", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(5.0)
        dispatcher.close()


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(parse_args(argv)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
