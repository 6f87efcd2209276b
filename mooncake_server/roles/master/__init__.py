"""The store master (`--role master`, or inside the conductor): index, placement, leases."""
