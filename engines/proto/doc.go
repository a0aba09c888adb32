// Package enginepb holds the Go code generated from engine.proto, the protocol between the slimen
// host and a policy engine in another process (see the proto file for its semantics), and the
// conversions between these messages and the types of package engines.
//
// To regenerate after editing engine.proto, with protoc from grpcio-tools and the two Go plugins
// (protoc-gen-go at the google.golang.org/protobuf version of go.mod) on PATH:
//
//	python3 -m venv /tmp/protoc-venv && /tmp/protoc-venv/bin/pip install grpcio-tools
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@latest
//	PATH=/tmp/protoc-venv/bin:$(go env GOPATH)/bin:$PATH go generate ./engines/proto
package enginepb

//go:generate python3 -m grpc_tools.protoc --proto_path=. --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative engine.proto

// ProtocolVersion is the version of engine.proto this code speaks; see the proto's header for
// when it changes.
const ProtocolVersion = 1

// InstanceHeader is the response header in which a server names its process (the `instance` of
// Info and Health) on every call, the Generate stream included: a client that sees it change
// knows that the engine restarted, without a Health call, and before it trusts the answer.
const InstanceHeader = "slimen-instance"
