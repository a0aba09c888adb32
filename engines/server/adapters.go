package server

import (
	"context"
	"errors"
	"fmt"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// loraCapability is the capability a server lists when it serves LoRA adapters (AddAdapter and
// the adapter field of requests), as the PyTorch worker does.
const loraCapability = "lora"

// noAdapters answers a call that needs adapters on an engine that holds none.
func noAdapters() error {
	return status.Errorf(codes.Unimplemented, "this engine holds no LoRA adapters (its server lists no %q capability); "+
		"serve an engine that does (the tiny engine, the torch worker) or remove lora: from the policy", loraCapability)
}

// holder is the served engine's adapters, or a status saying it has none.
func (s *service) holder() (engines.AdapterHolder, error) {
	if s.adapters == nil {
		return nil, noAdapters()
	}
	return s.adapters, nil
}

// adapterEngine is the engine as adapter name sees it.
func (s *service) adapterEngine(name string) (engines.Engine, error) {
	h, err := s.holder()
	if err != nil {
		return nil, err
	}
	e, err := h.AdapterEngine(name)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "%v (have %v)", err, h.AdapterNames())
	}
	return e, nil
}

// frozenBase refuses a call that would change the full weights while adapters sit on them.
func (s *service) frozenBase() error {
	if s.adapters == nil {
		return nil
	}
	if names := s.adapters.AdapterNames(); len(names) > 0 {
		return status.Errorf(codes.FailedPrecondition, "this engine's base is frozen under its LoRA adapters %v: name the adapter", names)
	}
	return nil
}

func (s *service) AddAdapter(ctx context.Context, req *enginepb.AddAdapterRequest) (*enginepb.AddAdapterResponse, error) {
	h, err := s.holder()
	if err != nil {
		return nil, err
	}
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "an adapter needs a name")
	}
	l := engines.LoRA{Rank: int(req.GetRank()), Alpha: req.GetAlpha(), Dropout: req.GetDropout(), Targets: req.GetTargets()}
	n, err := h.NewAdapter(req.GetName(), l, req.GetSeed())
	if errors.Is(err, engines.ErrAdapterExists) {
		return nil, status.Error(codes.AlreadyExists, err.Error())
	}
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return &enginepb.AddAdapterResponse{Params: n}, nil
}

func (s *service) RemoveAdapter(ctx context.Context, req *enginepb.RemoveAdapterRequest) (*enginepb.RemoveAdapterResponse, error) {
	h, err := s.holder()
	if err != nil {
		return nil, err
	}
	h.DropAdapter(req.GetName())
	return &enginepb.RemoveAdapterResponse{}, nil
}

// scoreAdapters scores reqs, request i with adapters[i] ("" the base): one engine call per
// adapter, the results put back in order.
func (s *service) scoreAdapters(ctx context.Context, reqs []engines.ScoreRequest, adapters []string) ([]engines.Scores, error) {
	var order []string
	idx := map[string][]int{}
	for i, a := range adapters {
		if _, ok := idx[a]; !ok {
			order = append(order, a)
		}
		idx[a] = append(idx[a], i)
	}
	out := make([]engines.Scores, len(reqs))
	for _, a := range order {
		eng := s.eng
		if a != "" {
			var err error
			if eng, err = s.adapterEngine(a); err != nil {
				return nil, err
			}
		}
		sub := make([]engines.ScoreRequest, len(idx[a]))
		for k, i := range idx[a] {
			sub[k] = reqs[i]
		}
		sc, err := eng.Score(ctx, sub)
		if err != nil {
			if a != "" {
				err = fmt.Errorf("adapter %q: %w", a, err)
			}
			return nil, toStatus(err)
		}
		if len(sc) != len(sub) {
			return nil, status.Errorf(codes.Internal, "the engine returned %d results for %d requests", len(sc), len(sub))
		}
		for k, i := range idx[a] {
			out[i] = sc[k]
		}
	}
	return out, nil
}
