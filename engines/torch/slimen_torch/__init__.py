"""slimen's PyTorch policy engine: a gRPC worker that generates with continuous batching over a
static KV cache and trains with the policy loss of DESIGN §4 (see docs/torch.md)."""

__version__ = "0.1.0"
