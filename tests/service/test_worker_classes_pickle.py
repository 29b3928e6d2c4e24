"""The workers' Ray actor classes pickle: the router actor and the pool manager carry them to place workers again
(group restarts, elastic pools). A typing.Generic base broke this once (Ray's actor class copies the class's
attributes, and Generic's cached __class_getitem__ does not pickle), so dsv4 serve with multi-rank workers failed."""

import ray
from ray import cloudpickle

from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker


def test_worker_actor_classes_pickle():
    for cls in (PrefillWorker, DecodeWorker):
        actor_class = ray.remote(num_cpus=0)(cls)
        assert cloudpickle.loads(cloudpickle.dumps(actor_class)).__ray_metadata__.class_name == cls.__name__
