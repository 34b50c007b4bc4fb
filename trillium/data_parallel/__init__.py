"""Data parallelism: `trillium serve --data-parallel-size N`, N engine replicas behind one api.

router.py     which replica serves a request (load with prefix affinity; pure)
client.py     ReplicaClient: the EngineClient surface over N EngineClients
control.py    control commands on every replica, one merged reply, one weight version
processes.py  per-replica ActorConfigs (own ipc dir, link secret, device); supervision, failure
metrics.py    every replica's engine series in one registry, labelled engine="<i>" (vLLM's label)

The engine's actors, the protocol and the HTTP planes do not change: a
replica is exactly the engine `trillium serve` runs without the flag.
"""
