package server

import (
	"context"
	"crypto/subtle"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// tokenAuth checks the bearer token of every call, unary and streaming alike.
type tokenAuth struct {
	token string // empty: no token needed
}

func (a tokenAuth) check(ctx context.Context) error {
	if a.token == "" {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get("authorization")
	if len(vals) == 0 {
		return status.Error(codes.Unauthenticated,
			"this engine server requires a bearer token and the call carried none: set the client's token environment variable (engine.token_env) to the server's token")
	}
	got, ok := strings.CutPrefix(vals[0], "Bearer ")
	// Constant time, so that the time a rejection takes says nothing about the token.
	if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(a.token)) != 1 {
		return status.Error(codes.Unauthenticated,
			"the bearer token does not match this engine server's: compare the client's token environment variable (engine.token_env) with the server's (--token-env)")
	}
	return nil
}

func (a tokenAuth) unary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := a.check(ctx); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

func (a tokenAuth) stream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := a.check(ss.Context()); err != nil {
		return err
	}
	return h(srv, ss)
}
