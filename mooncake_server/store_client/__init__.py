"""How engine roles reach the store: one node (StoreClient), all nodes (StoreCluster), a paged cache's blocks (KVStoreLink)."""
