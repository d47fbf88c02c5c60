"""The live service: ``router-sim serve`` and ``router-sim worker``.

``serve`` (:mod:`.app`) runs a :class:`~router_sim.router.routing.Router` as an HTTP service in
front of
a fleet (:mod:`.fleet`): its index is fed by the workers' KV event streams through an event
pump (:mod:`.pump`), its load view by what it forwards (:mod:`.inflight`), its state is
exposed as Prometheus metrics (:mod:`.metrics`); :mod:`.core` ties these together. ``worker``
(:mod:`.worker_proc`) runs one simulated engine (:mod:`.engine`) as a process with an
OpenAI-style completions API. Both speak the bodies of :mod:`.protocol`.
"""
