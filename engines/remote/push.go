package remote

import (
	"context"
	"fmt"
	"math"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc"
)

// Pushing weights between engines (engines.WeightsPusher): a server that lists "push" in
// Info.Capabilities (the PyTorch worker) joins a process group with other servers of the same
// model and sends or receives its weights through it (JoinPushGroup, PushWeights).

var _ engines.WeightsPusher = (*Client)(nil)

// CanPush says whether the server joins push groups ("push" in its capabilities).
func (c *Client) CanPush(ctx context.Context) (bool, error) {
	return c.capable(ctx, "push")
}

// JoinPushGroup has the server join group g as rank.
func (c *Client) JoinPushGroup(ctx context.Context, g engines.PushGroup, rank int) ([]string, error) {
	if rank < 0 || rank >= g.World || g.World > math.MaxInt32 {
		return nil, fmt.Errorf("engine at %s: join push group %q: rank %d of %d members", c.addr, g.Name, rank, g.World)
	}
	req := &enginepb.PushGroupRequest{InitMethod: g.InitMethod, Rank: int32(rank), World: int32(g.World), Group: g.Name, TimeoutS: g.TimeoutS}
	var links []string
	err := c.call(ctx, "join push group", req, func(ctx context.Context, o ...grpc.CallOption) error {
		resp, err := c.rpc.JoinPushGroup(ctx, req, o...)
		if err == nil {
			links = resp.GetLinks()
		}
		return err
	})
	return links, err
}

// PushWeights has the server send its weights to rank peer of the group (it is rank 0) or take
// them (it is rank peer).
func (c *Client) PushWeights(ctx context.Context, group string, peer, version int) (engines.PushStats, error) {
	if peer <= 0 || peer > math.MaxInt32 || version < 0 || version > math.MaxInt32 {
		return engines.PushStats{}, fmt.Errorf("engine at %s: push weights: peer %d, version %d out of range", c.addr, peer, version)
	}
	req := &enginepb.PushWeightsRequest{Group: group, Peer: int32(peer), Version: int32(version)}
	var st engines.PushStats
	err := c.call(ctx, "push weights", req, func(ctx context.Context, o ...grpc.CallOption) error {
		resp, err := c.rpc.PushWeights(ctx, req, o...)
		if err == nil {
			st = engines.PushStats{Bytes: resp.GetBytes(), Seconds: resp.GetSeconds(), Link: resp.GetLink()}
		}
		return err
	})
	return st, err
}
