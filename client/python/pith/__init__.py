"""Pith's Python client: drive jobs on a Pith cluster and load their checkpoints.

    import pith
    client = pith.Client()                    # the cluster `pith up` started, like the CLI
    job = client.submit("spec.json")          # a path, a JSON string or a dict
    for event in client.watch(job.job_id):    # one event per committed step
        print(event.step, event.loss)
    client.checkpoint(job.job_id, "w.safetensors")
    weights = pith.load_checkpoint("w.safetensors")   # named torch tensors + the spec

Every object the client returns is a message of Pith's protos (pith.v1, generated at
build time from proto/pith/v1/*.proto), the same the `pith` CLI prints with
`--output json`; `pith.to_dict(message)` gives exactly that JSON's value.
"""

from pith._checkpoint import Checkpoint, load_checkpoint
from pith._client import Client, Error, state_name, to_dict
from pith.v1 import job_pb2 as _job_pb2

JobState = _job_pb2.JobState

__all__ = [
    "Checkpoint",
    "Client",
    "Error",
    "JobState",
    "load_checkpoint",
    "state_name",
    "to_dict",
]
