"""What crosses process boundaries: typed messages per channel, the internal HTTP routes, the RPC channel, the cluster-secret guards."""
