package server

import (
	"context"
	"fmt"
	"slices"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The weights versions of the asynchronous loop (engines.Versions, docs/async.md), served for an
// engine that keeps them (the tiny engine does): Info lists "versions", KeepVersion and
// DropVersions reach the engine's methods, and a generate request, a Score call or a Save call
// that names a version samples, scores or writes that kept version while Train goes on. For an
// engine without them the calls answer UNIMPLEMENTED and Info lists no "versions", so that a
// host keeps rollout replicas or refuses rollout.max_staleness > 0 instead.

// versionsCapability is the capability a server lists when it keeps weights versions.
const versionsCapability = "versions"

// keeper returns the served engine's weights versions, or a status that says it has none. An
// engine that keeps them only when what it reaches keeps them (a remote client, served by
// `slimen serve --config` of a remote or torch policy: engines.VersionsProber) is asked until it
// says yes.
func (s *service) keeper(ctx context.Context) (engines.Versions, error) {
	vs, ok := s.eng.(engines.Versions)
	if !ok {
		return nil, status.Error(codes.Unimplemented, "this engine keeps no weights versions (its server lists no \"versions\" "+
			"capability): sample the current weights, or give the host rollout replicas (docs/async.md)")
	}
	if p, asks := s.eng.(engines.VersionsProber); asks && !s.keeps.Load() {
		keeps, err := p.KeepsVersions(ctx)
		if err != nil {
			return nil, toStatus(err)
		}
		if !keeps {
			return nil, status.Error(codes.Unimplemented, "this engine keeps no weights versions: the engine it serves lists no \"versions\" capability")
		}
		s.keeps.Store(true)
	}
	return vs, nil
}

// withVersionsCapability adds "versions" to caps when the engine keeps weights versions.
func (s *service) withVersionsCapability(ctx context.Context, caps []string) []string {
	if slices.Contains(caps, versionsCapability) {
		return caps
	}
	if _, err := s.keeper(ctx); err != nil {
		return caps
	}
	return append(caps, versionsCapability)
}

// version reads the optional version field of a request: nil when it names none.
func version(v *int32) (*int, error) {
	if v == nil {
		return nil, nil
	}
	if *v < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "weights version %d: versions count training steps and are ≥ 0", *v)
	}
	n := int(*v)
	return &n, nil
}

// KeepVersion has the engine copy its current weights as kept version req.version. Completions
// of an earlier copy kept under that number are forgotten: a resent request of the version is
// sampled from the new copy.
func (s *service) KeepVersion(ctx context.Context, req *enginepb.VersionRequest) (*enginepb.VersionResponse, error) {
	vs, err := s.keeper(ctx)
	if err != nil {
		return nil, err
	}
	v, err := version(&req.Version)
	if err != nil {
		return nil, err
	}
	if err := vs.KeepVersion(ctx, *v); err != nil {
		return nil, toStatus(fmt.Errorf("keep weights version %d: %w", *v, err))
	}
	s.gen.forgetVersion(*v)
	return &enginepb.VersionResponse{}, nil
}

// DropVersions has the engine forget every kept version below req.version.
func (s *service) DropVersions(ctx context.Context, req *enginepb.VersionRequest) (*enginepb.VersionResponse, error) {
	vs, err := s.keeper(ctx)
	if err != nil {
		return nil, err
	}
	below, err := version(&req.Version)
	if err != nil {
		return nil, err
	}
	if err := vs.DropVersions(ctx, *below); err != nil {
		return nil, toStatus(fmt.Errorf("drop weights versions below %d: %w", *below, err))
	}
	return &enginepb.VersionResponse{}, nil
}
