"""What crosses from prefill to decode: MetadataBuffers, the KV + metadata transfer over
torch.distributed (NCCL on GPU, gloo on CPU), and the handshake messages.

Not built yet: a later milestone fills this package.
"""
