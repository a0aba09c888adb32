// Package server serves any engines.Engine over the slimen engine protocol (engines/proto), so that
// a host in another process or on another machine can use it through engines/remote. It adds what
// the protocol promises on top of the plain Engine interface: continuous batching of streamed
// generate requests, answering a resent request or optimizer step once, bearer-token checks and
// message size limits.
package server

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// DefaultMaxMessageBytes is the largest message sent or received when Options leaves it zero.
const DefaultMaxMessageBytes = 64 << 20

// Options configure a server. The zero value serves plaintext, without a token, confines Save and
// Load to the working directory, and has the defaults below.
type Options struct {
	// Token, when set, is the bearer token every call must carry.
	Token string
	// TLS, when set, serves TLS with this configuration (see TLSConfig).
	TLS *tls.Config
	// Insecure allows Listen to bind a non-loopback address without TLS.
	Insecure bool
	// Roots are the folders a client's Save and Load may name: a request's folder, taken
	// relative to the first root when it is relative, must lie inside one of them once cleaned
	// and its symbolic links resolved, or the call fails with PERMISSION_DENIED (see
	// ResolveRoots). Empty: the working directory.
	Roots []string
	// MaxMessageBytes bounds every message in both directions; 0: DefaultMaxMessageBytes.
	MaxMessageBytes int

	// BatchWindow is how long a generate request waits for others to join its batch when the
	// engine has room. 0 (the default) starts at once: requests sent in one stream message form
	// one batch, and requests arriving while the engine is busy are gathered anyway.
	BatchWindow time.Duration
	// MaxConcurrentBatches is how many engine Generate calls run at once; 0: 4. More than one
	// lets a short batch finish while a long one is still sampling.
	MaxConcurrentBatches int
	// MaxBatchSamples caps the samples (Σ n) of one engine Generate call; 0: no cap.
	MaxBatchSamples int
	// DedupWindow is how long a finished generate request's completions are kept for a resend
	// of its id; 0: 10 minutes.
	DedupWindow time.Duration
	// DedupMaxBytes caps the size of the completions kept for resends; 0: 1 GiB. The oldest go
	// first; a resend of a forgotten id is sampled again.
	DedupMaxBytes int
	// TrainMemory is how many recent optimizer step ids are remembered; 0: 1024.
	TrainMemory int

	// Drain, when closed, ends each Generate stream as soon as no request it carries is in
	// flight; close it before GracefulStop, which would otherwise wait for the clients' idle
	// long-lived streams. Clients reconnect (to the next server) for what they still need.
	Drain chan struct{}

	// Logf, when set, receives what the server has to say that no caller sees (an engine panic, a
	// failing batch being retried request by request).
	Logf func(format string, args ...any)
}

func (o Options) withDefaults() Options {
	if o.MaxMessageBytes <= 0 {
		o.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if o.MaxConcurrentBatches <= 0 {
		o.MaxConcurrentBatches = 4
	}
	if o.DedupWindow <= 0 {
		o.DedupWindow = 10 * time.Minute
	}
	if o.DedupMaxBytes <= 0 {
		o.DedupMaxBytes = 1 << 30
	}
	if o.TrainMemory <= 0 {
		o.TrainMemory = 1024
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	return o
}

// New returns a gRPC server that serves eng over the engine protocol; start it with
// Serve(Listen(address, opts)). Stopping the server does not close eng.
func New(eng engines.Engine, opts Options) *grpc.Server {
	opts = opts.withDefaults()
	svc := newService(eng, opts)
	if svc.roots.err != nil {
		opts.Logf("engine server: every Save and Load will fail: %v", svc.roots.err)
	}
	return newGRPCServer(svc, opts)
}

func newGRPCServer(svc *service, opts Options) *grpc.Server {
	sopts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(opts.MaxMessageBytes),
		grpc.MaxSendMsgSize(opts.MaxMessageBytes),
		grpc.ChainUnaryInterceptor(svc.auth.unary, svc.stampUnary),
		grpc.ChainStreamInterceptor(svc.auth.stream),
		// Pings find a host that vanished without closing its connection; the policy admits the
		// client's own pings (engines/remote pings every 30 s, also between calls).
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: time.Minute, Timeout: 20 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
	if opts.TLS != nil {
		sopts = append(sopts, grpc.Creds(credentials.NewTLS(opts.TLS)))
	}
	s := grpc.NewServer(sopts...)
	enginepb.RegisterEngineServer(s, svc)
	return s
}

// service implements enginepb.EngineServer over one engine.
type service struct {
	enginepb.UnimplementedEngineServer
	eng      engines.Engine
	opts     Options
	instance string
	auth     tokenAuth
	roots    roots
	gen      *generator
	train    *trainLog
	keeps    atomic.Bool           // the engine, an engines.VersionsProber, said it keeps weights versions
	adapters engines.AdapterHolder // the engine's LoRA adapters (adapters.go); nil: it holds none
}

func newService(eng engines.Engine, opts Options) *service {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	s := &service{
		eng:      eng,
		opts:     opts,
		instance: hex.EncodeToString(b[:]),
		auth:     tokenAuth{token: opts.Token},
		roots:    newRoots(opts.Roots),
		train:    newTrainLog(opts.TrainMemory),
	}
	s.adapters, _ = eng.(engines.AdapterHolder)
	s.gen = newGenerator(eng, opts, s.keeper)
	s.gen.adapters = s.adapters
	return s
}

// stampUnary names this server process in the header of every unary answer, so that a client
// notices a restarted engine on the first call it answers (Generate sends it in its own header).
func (s *service) stampUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	_ = grpc.SetHeader(ctx, metadata.Pairs(enginepb.InstanceHeader, s.instance))
	return h(ctx, req)
}

func (s *service) checkVersion(v uint32) error {
	if v != 0 && v != enginepb.ProtocolVersion {
		return status.Errorf(codes.FailedPrecondition,
			"the client speaks engine protocol version %d and this server version %d: run the same slimen release on both sides",
			v, enginepb.ProtocolVersion)
	}
	return nil
}

func (s *service) Info(ctx context.Context, req *enginepb.InfoRequest) (*enginepb.InfoResponse, error) {
	if err := s.checkVersion(req.GetProtocolVersion()); err != nil {
		return nil, err
	}
	info, err := s.eng.Info(ctx)
	if err != nil {
		return nil, toStatus(err)
	}
	info.Capabilities = s.withVersionsCapability(ctx, info.Capabilities)
	if s.adapters != nil && !slices.Contains(info.Capabilities, loraCapability) {
		info.Capabilities = append(slices.Clip(info.Capabilities), loraCapability)
	}
	return &enginepb.InfoResponse{
		ProtocolVersion: enginepb.ProtocolVersion,
		Instance:        s.instance,
		Info:            enginepb.EncodeInfo(info),
	}, nil
}

func (s *service) Health(context.Context, *enginepb.HealthRequest) (*enginepb.HealthResponse, error) {
	return &enginepb.HealthResponse{
		Status:          enginepb.HealthResponse_SERVING,
		ProtocolVersion: enginepb.ProtocolVersion,
		Instance:        s.instance,
	}, nil
}

// Score scores with the current weights, with the LoRA adapters the requests name, or with the
// kept weights version the request names.
func (s *service) Score(ctx context.Context, req *enginepb.ScoreBatchRequest) (*enginepb.ScoreBatchResponse, error) {
	v, err := version(req.Version)
	if err != nil {
		return nil, err
	}
	reqs := make([]engines.ScoreRequest, len(req.GetRequests()))
	var adapters []string
	for i, r := range req.GetRequests() {
		reqs[i] = enginepb.DecodeScoreRequest(r)
		if a := r.GetAdapter(); a != "" {
			if adapters == nil {
				adapters = make([]string, len(reqs))
			}
			adapters[i] = a
		}
	}
	var scores []engines.Scores
	if adapters != nil {
		if v != nil {
			return nil, status.Error(codes.InvalidArgument, "score: weights versions are of the full weights, "+
				"not of a LoRA adapter: name a version or an adapter, not both")
		}
		if scores, err = s.scoreAdapters(ctx, reqs, adapters); err != nil {
			return nil, err
		}
	} else if v != nil {
		vs, err := s.keeper(ctx)
		if err != nil {
			return nil, err
		}
		scores, err = vs.ScoreVersion(ctx, *v, reqs)
		if err != nil {
			return nil, toStatus(fmt.Errorf("score with weights version %d: %w", *v, err))
		}
	} else if scores, err = s.eng.Score(ctx, reqs); err != nil {
		return nil, toStatus(err)
	}
	if len(scores) != len(reqs) {
		return nil, status.Errorf(codes.Internal, "the engine returned %d results for %d requests", len(scores), len(reqs))
	}
	out := &enginepb.ScoreBatchResponse{Scores: make([]*enginepb.Scores, len(scores))}
	for i, sc := range scores {
		out.Scores[i] = &enginepb.Scores{Logprobs: sc.Logprobs}
	}
	return out, nil
}

// Render serves the engine's chat template (engines.Renderer); an engine without one answers
// UNIMPLEMENTED.
func (s *service) Render(ctx context.Context, req *enginepb.RenderBatchRequest) (*enginepb.RenderResponse, error) {
	rd, ok := s.eng.(engines.Renderer)
	if !ok {
		return nil, status.Error(codes.Unimplemented, "this engine cannot render a chat template to tokens")
	}
	reqs := make([]engines.RenderRequest, len(req.GetRequests()))
	for i, r := range req.GetRequests() {
		reqs[i] = enginepb.DecodeRenderRequest(r)
	}
	toks, err := rd.Render(ctx, reqs)
	if err != nil {
		return nil, toStatus(err)
	}
	if len(toks) != len(reqs) {
		return nil, status.Errorf(codes.Internal, "the engine returned %d results for %d requests", len(toks), len(reqs))
	}
	out := &enginepb.RenderResponse{Tokens: make([]*enginepb.TokenIds, len(toks))}
	for i, t := range toks {
		out.Tokens[i] = &enginepb.TokenIds{Ids: t}
	}
	return out, nil
}

// Values serves a critic's value head; an engine without one answers UNIMPLEMENTED.
func (s *service) Values(ctx context.Context, req *enginepb.ScoreBatchRequest) (*enginepb.ValuesResponse, error) {
	v, ok := s.eng.(engines.Valuer)
	if !ok {
		return nil, status.Error(codes.Unimplemented, "this engine has no value head (it is not a PPO critic)")
	}
	reqs := make([]engines.ScoreRequest, len(req.GetRequests()))
	for i, r := range req.GetRequests() {
		reqs[i] = enginepb.DecodeScoreRequest(r)
	}
	vals, err := v.Values(ctx, reqs)
	if err != nil {
		return nil, toStatus(err)
	}
	if len(vals) != len(reqs) {
		return nil, status.Errorf(codes.Internal, "the engine returned %d results for %d requests", len(vals), len(reqs))
	}
	out := &enginepb.ValuesResponse{Values: make([]*enginepb.Scores, len(vals))}
	for i, x := range vals {
		out.Values[i] = &enginepb.Scores{Logprobs: x}
	}
	return out, nil
}

func (s *service) Train(ctx context.Context, req *enginepb.TrainRequest) (*enginepb.TrainResponse, error) {
	b := req.GetBatch()
	if b.GetId() == "" {
		return nil, status.Error(codes.InvalidArgument, "the batch has no id; the protocol needs one per optimizer step so that a resent step is applied once")
	}
	// An adapter's steps are remembered apart from the base's and the other adapters'.
	fp, err := fingerprint(req)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "%v", err)
	}
	eng := s.eng
	if a := req.GetAdapter(); a != "" {
		if eng, err = s.adapterEngine(a); err != nil {
			return nil, err
		}
	} else if err := s.frozenBase(); err != nil {
		return nil, err
	}
	id := b.GetId()
	if a := req.GetAdapter(); a != "" {
		id = "adapter " + a + ": " + id
	}
	stats, dup, err := s.train.apply(ctx, id, fp, func(ctx context.Context) (engines.TrainStats, error) {
		return eng.Train(ctx, enginepb.DecodeBatch(b))
	})
	if err != nil {
		return nil, toStatus(err)
	}
	return &enginepb.TrainResponse{Stats: enginepb.EncodeTrainStats(stats), Duplicate: dup}, nil
}

func (s *service) Tokenize(ctx context.Context, req *enginepb.TokenizeRequest) (*enginepb.TokenizeResponse, error) {
	toks, err := s.eng.Tokenize(ctx, req.GetTexts())
	if err != nil {
		return nil, toStatus(err)
	}
	if len(toks) != len(req.GetTexts()) {
		return nil, status.Errorf(codes.Internal, "the engine returned %d results for %d texts", len(toks), len(req.GetTexts()))
	}
	out := &enginepb.TokenizeResponse{Tokens: make([]*enginepb.TokenIds, len(toks))}
	for i, t := range toks {
		out.Tokens[i] = &enginepb.TokenIds{Ids: t}
	}
	return out, nil
}

// Save writes the current weights and optimizer state into a folder inside the server's roots,
// or, when the request names a kept weights version, that version's weights (no optimizer state).
func (s *service) Save(ctx context.Context, req *enginepb.SaveRequest) (*enginepb.SaveResponse, error) {
	v, err := version(req.Version)
	if err != nil {
		return nil, err
	}
	dir, err := s.roots.resolve("save", req.GetDir())
	if err != nil {
		return nil, err
	}
	if a := req.GetAdapter(); a != "" {
		if v != nil {
			return nil, status.Error(codes.InvalidArgument, "save: weights versions are of the full weights, "+
				"not of a LoRA adapter: name a version or an adapter, not both")
		}
		eng, err := s.adapterEngine(a)
		if err != nil {
			return nil, err
		}
		if err := eng.Save(ctx, dir); err != nil {
			return nil, toStatus(fmt.Errorf("adapter %q: %w", a, err))
		}
		return &enginepb.SaveResponse{}, nil
	}
	if v != nil {
		vs, err := s.keeper(ctx)
		if err != nil {
			return nil, err
		}
		if err := vs.SaveVersion(ctx, *v, dir); err != nil {
			return nil, toStatus(fmt.Errorf("save weights version %d: %w", *v, err))
		}
		return &enginepb.SaveResponse{}, nil
	}
	if err := s.eng.Save(ctx, dir); err != nil {
		return nil, toStatus(err)
	}
	return &enginepb.SaveResponse{}, nil
}

func (s *service) Load(ctx context.Context, req *enginepb.LoadRequest) (*enginepb.LoadResponse, error) {
	// A model built into the binary (builtin:NAME) names no folder, so there is nothing to
	// confine: a host resets a server it trains to the model the server was started with that way.
	dir := req.GetDir()
	if !builtinModel(dir) {
		var err error
		if dir, err = s.roots.resolve("load", dir); err != nil {
			return nil, err
		}
	}
	if a := req.GetAdapter(); a != "" {
		h, err := s.holder()
		if err != nil {
			return nil, err
		}
		if builtinModel(req.GetDir()) {
			return nil, status.Errorf(codes.InvalidArgument, "load adapter %q: %s is a model, not a PEFT folder", a, req.GetDir())
		}
		if err := h.LoadAdapter(ctx, a, dir); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "%v", err)
		}
	} else if err := s.frozenBase(); err != nil {
		return nil, err
	} else if err := s.eng.Load(ctx, dir); err != nil {
		return nil, toStatus(err)
	}
	// The weights went back in time: a step id applied before must apply again, and completions
	// sampled from the old weights must not answer new requests.
	s.train.forget()
	s.gen.forgetFinished()
	return &enginepb.LoadResponse{}, nil
}

// builtinModel says whether a Load names a model built into the engine (builtin:NAME) rather
// than a folder.
func builtinModel(dir string) bool {
	name, ok := strings.CutPrefix(dir, "builtin:")
	return ok && name != "" && !strings.ContainsAny(name, `/\`) && name != "." && name != ".."
}

// toStatus turns an engine error into the status the protocol promises for it.
func toStatus(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	switch {
	case errors.Is(err, engines.ErrNotSupported):
		return status.Error(codes.Unimplemented, err.Error())
	case errors.Is(err, engines.ErrVersionNotKept):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	}
	return status.Error(codes.Unknown, err.Error())
}

// fingerprint identifies a request's content, so that an id reused for a different request is
// caught instead of answered with the wrong results.
func fingerprint(m proto.Message) ([32]byte, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return [32]byte{}, fmt.Errorf("fingerprint: %w", err)
	}
	return sha256.Sum256(b), nil
}
