"""The exchange between groups: the striped averager over the data plane, the network plans that
shape it, the quorum averager (fault tolerance: quorums, votes, retries), a rank's liveness towards
the coordinator (heartbeats, rejoins) and healing's state transfer. A new failure rule goes in
``quorum_averager.py`` (its pure decisions in ``diloco.coordinator.rounds``); a new way to spread a
vector over a group's ranks in ``striped.py``.
"""
