"""Request router: places each request on a prefill and a decode worker and streams tokens over gRPC.

- `dsv4_router.proto` / `protos.py` / `_gen/`: the API and its (checked-in, self-refreshing) stubs.
- `dispatch.py`: the `Dispatcher` protocol the worker layer implements, `WorkerInfo`, `WorkerDied`.
- `policy.py`: block hashing, per-worker prefix LRU, round_robin / least_loaded / cache_aware placement.
- `server.py`: `RouterServer`, the grpc.aio service (Generate / Health / Stats, retry, health loop).
- `local_dispatch.py`: `LocalDispatcher`, N in-process engines (tests, colocated single-engine mode).
- `client.py`: `RouterClient` / `AsyncRouterClient`.
- `metrics.py`: decision and error counters.
Nothing is imported here, so `router.policy` stays usable without grpc installed.
"""
