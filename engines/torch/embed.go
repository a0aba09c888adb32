// Package torch carries the Python worker of engines/torch (the slimen_torch package) inside the
// Go binary, so that a slimen binary can start a worker of exactly its own protocol version on any
// machine with a Python environment that has the worker's requirements (requirements.txt).
// engines/torchproc unpacks it and starts it.
package torch

import "embed"

// Package holds slimen_torch/*.py and its generated gRPC stubs, rooted at "slimen_torch".
//
//go:embed slimen_torch/*.py slimen_torch/proto/*.py
var Package embed.FS
