"""The decode process: KV from the store -> continuous-batch decoding; admission and write-back."""
