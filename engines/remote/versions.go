package remote

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc"
)

// The weights versions of the asynchronous loop (engines.Versions, docs/async.md), kept by the
// server itself: a server that lists "versions" in Info.Capabilities (the PyTorch worker, which
// copies its weights on the device at KeepVersion; `slimen serve` of an engine with
// engines.Versions) samples a kept version while it trains. A server without it (an older
// release, a worker with --no-versions, `slimen serve` of an engine that keeps none) has none of
// this; the host asks KeepsVersions before it uses them, and keeps rollout replicas for such an
// engine instead, or refuses rollout.max_staleness > 0 for a server it does not own.

var _ engines.Versions = (*Client)(nil)

// KeepsVersions says whether the server keeps weights versions ("versions" in its capabilities).
func (c *Client) KeepsVersions(ctx context.Context) (bool, error) {
	ok, err := c.capable(ctx, "versions")
	if err == nil {
		c.versions.Store(ok)
	}
	return ok, err
}

// capable says whether the server lists capability in Info.Capabilities.
func (c *Client) capable(ctx context.Context, capability string) (bool, error) {
	info, err := c.Info(ctx)
	if err != nil {
		return false, err
	}
	return slices.Contains(info.Capabilities, capability), nil
}

func (c *Client) version(method string, v int) (*int32, error) {
	if !c.versions.Load() {
		return nil, fmt.Errorf("engine at %s: %s: the server does not keep weights versions (no \"versions\" in its "+
			"capabilities), or KeepsVersions was not asked", c.addr, method)
	}
	if v < 0 || v > math.MaxInt32 {
		return nil, fmt.Errorf("engine at %s: %s: weights version %d out of range", c.addr, method, v)
	}
	n := int32(v)
	return &n, nil
}

// KeepVersion has the server copy its current weights into kept version v.
func (c *Client) KeepVersion(ctx context.Context, v int) error {
	n, err := c.version("keep version", v)
	if err != nil {
		return err
	}
	req := &enginepb.VersionRequest{Version: *n}
	return c.call(ctx, "keep version", req, func(ctx context.Context, o ...grpc.CallOption) error {
		_, err := c.rpc.KeepVersion(ctx, req, o...)
		return err
	})
}

// GenerateVersion samples reqs from kept version v, as Generate does from the current weights.
func (c *Client) GenerateVersion(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	n, err := c.version("generate", v)
	if err != nil {
		return nil, err
	}
	return c.generate(ctx, reqs, nil, n)
}

// ScoreVersion scores reqs with kept version v.
func (c *Client) ScoreVersion(ctx context.Context, v int, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	n, err := c.version("score", v)
	if err != nil {
		return nil, err
	}
	return c.score(ctx, reqs, "", n)
}

// SaveVersion has the server write kept version v into dir (a model folder, no optimizer state).
func (c *Client) SaveVersion(ctx context.Context, v int, dir string) error {
	n, err := c.version("save version", v)
	if err != nil {
		return err
	}
	return c.save(ctx, n, dir)
}

// DropVersions has the server forget every kept version below v.
func (c *Client) DropVersions(ctx context.Context, below int) error {
	n, err := c.version("drop versions", max(below, 0))
	if err != nil {
		return err
	}
	req := &enginepb.VersionRequest{Version: *n}
	return c.call(ctx, "drop versions", req, func(ctx context.Context, o ...grpc.CallOption) error {
		_, err := c.rpc.DropVersions(ctx, req, o...)
		return err
	})
}
