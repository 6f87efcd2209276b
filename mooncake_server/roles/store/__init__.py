"""The store process: one node's DRAM pool and SSD tier, served over the transfer engine and RPC."""
