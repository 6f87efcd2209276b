"""What crosses process boundaries: typed messages per channel, the RPC channel, the cluster-secret guards."""
