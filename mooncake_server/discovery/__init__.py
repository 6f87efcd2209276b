"""Discovery on etcd (`--etcd`): who is in the cluster, held by leases, watched by conductors.

Keys under `--etcd-prefix`: `instances/<role>/<id>` = an instance's `InstanceInfo`,
`conductors/<id>` = a conductor's `ConductorInfo`; each lives under its process's lease
(keep-alive = liveness). etcd.py wraps the client library, leased_key.py keeps one key alive,
prefix_watch.py follows a prefix, registry_feed.py feeds the instances into a conductor's
registry, conductors.py tells an instance which conductors to join.
"""
