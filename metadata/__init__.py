"""What crosses from prefill to decode: MetadataBuffers, the KV + metadata transfer over
torch.distributed (NCCL on GPU, gloo on CPU), the control-plane messages and sockets, and the
pairing check; plus what both node kinds share (metadata.serving_node, metadata.node_common).
"""
