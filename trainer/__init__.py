"""The PyTorch workload: a small GPT trained data-parallel over gloo, speaking the contract of schema/contract.py."""
