"""Online adaptation (docs/serve.md#online-adaptation): Serve's heads follow the traffic they serve, losslessly.

The replica records a sampled share of its requests (`record.Recorder`: the verify forward's own features and the
committed tokens) into a bounded buffer (`buffer.TrafficBuffer`); a Ray actor beside it keeps training the served
head on that buffer with the project's losses (`trainer_actor.OnlineTrainer`) and publishes a version
(`versions.VersionStore`) only when it agrees better with the target on the newest traffic; the replica loads it
between decode steps and rolls back when live acceptance falls below the previous version's (`swap`).
A routed model adapts per head (`routed`, `heads`) and, with `serve.adapt.spawn`, grows a head for traffic no head
drafts well: the replica's rule asks (`spawn`), the trainer forks the closest head and trains it on that traffic
(`spawner`), the replica adds it to the router between steps. Sharing a host with replicas, the trainer trains
at most `serve.adapt.trainer_duty` of the time (`duty`).
Verification is untouched, so every version is lossless: a head only changes how many drafted tokens are accepted.
"""
