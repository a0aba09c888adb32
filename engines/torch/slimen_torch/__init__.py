"""slimen's PyTorch policy engine: a gRPC worker that generates with continuous batching over a
static KV cache and trains with the policy loss of docs/architecture.md (see docs/torch.md)."""

__version__ = "0.1.0"
