"""The host ledger: one FP32 master, Adam moments and a BF16 copy per host, its memory and its views."""
