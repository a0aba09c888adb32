package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// StreamGenerator is implemented by engines that can hand back each completion as soon as it is
// sampled, instead of the whole batch at the end. The server prefers it over Engine.Generate, so
// that a short response in a batch is not held back by a long one. emit may be called from any
// goroutine, once per sample, in any order.
type StreamGenerator interface {
	GenerateStream(ctx context.Context, reqs []engines.GenerateRequest, emit func(engines.Completion)) error
}

// generator is the server side of the Generate stream: it gathers the requests of all streams
// into engine batches, routes each completion to the streams waiting for it, and keeps finished
// requests for a while so that a resent id is answered from memory instead of sampled again.
type generator struct {
	eng    engines.Engine
	stream StreamGenerator // eng, when it streams; nil otherwise
	opts   Options
	// keeper gives the engine's kept weights versions for requests that name one (the service's
	// keeper), or a status saying it keeps none.
	keeper func(context.Context) (engines.Versions, error)
	// adapters are the engine's LoRA adapters; nil: requests that name one are refused.
	adapters engines.AdapterHolder

	mu       sync.Mutex
	entries  map[string]*genEntry // every request known by id: queued, running or finished
	finished []*genEntry          // finished requests, oldest first, for forgetting them
	kept     int                  // bytes of the completions of finished
	queue    []*genEntry          // requests waiting for a batch
	queued   int                  // samples in queue
	running  int                  // engine calls under way
	timer    *time.Timer          // armed while the queue waits for BatchWindow
	ready    bool                 // BatchWindow has passed for the queue
}

type entryState int

const (
	stateQueued entryState = iota
	stateRunning
	stateEnded // finished, failed or dropped: nothing more is delivered
)

// genEntry is one request id.
type genEntry struct {
	id         string
	fp         [32]byte
	req        engines.GenerateRequest
	version    *int   // the kept weights version that samples it; nil: the current weights
	adapter    string // the LoRA adapter that samples it; "": the base
	n          int
	got        []*enginepb.Completion // by sample index; nil until sampled
	ngot       int
	bytes      int // of got, on the wire
	state      entryState
	subs       map[*session]struct{} // streams waiting for it
	batch      *batch                // while running
	finishedAt time.Time
}

// batch is one engine Generate call.
type batch struct {
	cancel  context.CancelFunc
	entries []*genEntry
}

// session is one Generate stream. Completions for it queue up here and the stream's handler
// sends them, because a gRPC stream takes one sender at a time.
type session struct {
	mu    sync.Mutex
	comps []*enginepb.Completion
	errs  []*enginepb.RequestError
	wake  chan struct{}

	// Guarded by generator.mu.
	subs   map[string]*genEntry
	closed bool
}

func newGenerator(eng engines.Engine, opts Options, keeper func(context.Context) (engines.Versions, error)) *generator {
	g := &generator{eng: eng, opts: opts, keeper: keeper, entries: map[string]*genEntry{}}
	g.stream, _ = eng.(StreamGenerator)
	return g
}

func (s *session) push(c *enginepb.Completion, e *enginepb.RequestError) {
	s.mu.Lock()
	if c != nil {
		s.comps = append(s.comps, c)
	}
	if e != nil {
		s.errs = append(s.errs, e)
	}
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func requestError(id string, code codes.Code, format string, args ...any) *enginepb.RequestError {
	return &enginepb.RequestError{RequestId: id, Code: int32(code), Message: fmt.Sprintf(format, args...)}
}

// Generate serves one stream: requests in, completions out as they finish.
func (s *service) Generate(stream enginepb.Engine_GenerateServer) error {
	// The header tells the client at once that the stream is up (and the token accepted), before
	// any completion is ready, and which server process answers: the client checks that before it
	// sends anything.
	if err := stream.SendHeader(metadata.Pairs(enginepb.InstanceHeader, s.instance)); err != nil {
		return err
	}
	g := s.gen
	sess := &session{wake: make(chan struct{}, 1), subs: map[string]*genEntry{}}
	defer g.leave(sess)
	recvErr := make(chan error, 1)
	go func() {
		for {
			msg, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			if len(msg.GetCancel()) > 0 {
				g.cancel(sess, msg.GetCancel())
			}
			if len(msg.GetRequests()) > 0 {
				g.submit(stream.Context(), sess, msg.GetRequests())
			}
		}
	}()
	ctx := stream.Context()
	recvDone := false
	drain := s.opts.Drain // nil (blocks forever) unless the server is told to drain
	for {
		select {
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-drain:
			recvDone, drain = true, nil // as if the client had finished sending
		case err := <-recvErr:
			if err != io.EOF {
				return err
			}
			// The client sent all it will; answer what it waits for, then end.
			recvDone = true
			recvErr = nil
		case <-sess.wake:
		}
		// Checked before the flush: once nothing is awaited no more completions can arrive,
		// so the flush below sends the last of them.
		idle := recvDone && g.waiting(sess) == 0
		if err := s.flush(stream, sess); err != nil {
			return err
		}
		if idle {
			return nil
		}
	}
}

// flush sends what has queued up for sess, several completions a message, each message well
// under the size limit.
func (s *service) flush(stream enginepb.Engine_GenerateServer, sess *session) error {
	sess.mu.Lock()
	comps, errs := sess.comps, sess.errs
	sess.comps, sess.errs = nil, nil
	sess.mu.Unlock()
	limit := s.opts.MaxMessageBytes / 2
	msg := &enginepb.GenerateStreamResponse{Errors: errs}
	size := proto.Size(msg)
	for _, c := range comps {
		cs := proto.Size(c) + 8 // field tag and length
		if len(msg.Completions) > 0 && size+cs > limit {
			if err := stream.Send(msg); err != nil {
				return err
			}
			msg, size = &enginepb.GenerateStreamResponse{}, 0
		}
		msg.Completions = append(msg.Completions, c)
		size += cs
	}
	if len(msg.Completions) > 0 || len(msg.Errors) > 0 {
		return stream.Send(msg)
	}
	return nil
}

// submit takes the requests of one stream message. A known id is answered from the entry it
// already has (finished: at once; running or queued: as its samples come), never sampled again.
// A request that names a weights version is refused at once when the engine keeps none.
func (g *generator) submit(ctx context.Context, sess *session, reqs []*enginepb.GenerateRequest) {
	fps := make([][32]byte, len(reqs))
	vers := make([]*int, len(reqs))
	verErrs := make([]error, len(reqs))
	for i, r := range reqs {
		fps[i], _ = fingerprint(r) // a message that was just unmarshaled marshals again
		if vers[i], verErrs[i] = version(r.Version); verErrs[i] == nil && vers[i] != nil {
			_, verErrs[i] = g.keeper(ctx)
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if sess.closed {
		return
	}
	for i, r := range reqs {
		id := r.GetId()
		switch {
		case id == "":
			sess.push(nil, requestError(id, codes.InvalidArgument, "generate request without an id: the protocol needs one per "+
				"request so that a resent request is answered once"))
			continue
		case r.GetN() < 0:
			sess.push(nil, requestError(id, codes.InvalidArgument, "generate request %q asks for n = %d samples; n must be ≥ 0 (0 is read as 1)", id, r.GetN()))
			continue
		case r.GetAdapter() != "" && g.adapters == nil:
			sess.push(nil, requestError(id, codes.Unimplemented, "generate request %q names LoRA adapter %q, "+
				"and this engine holds no adapters (its server lists no %q capability)", id, r.GetAdapter(), loraCapability))
			continue
		case r.GetAdapter() != "" && r.Version != nil:
			sess.push(nil, requestError(id, codes.InvalidArgument, "generate request %q names LoRA adapter %q and weights version "+
				"%d: versions are of the full weights; name one or the other", id, r.GetAdapter(), r.GetVersion()))
			continue
		case verErrs[i] != nil:
			st := status.Convert(verErrs[i])
			sess.push(nil, requestError(id, st.Code(), "generate request %q names weights version %d: %s", id, r.GetVersion(), st.Message()))
			continue
		}
		if _, waiting := sess.subs[id]; waiting {
			continue // already waiting for it on this stream
		}
		if e, ok := g.entries[id]; ok {
			if e.fp != fps[i] {
				sess.push(nil, requestError(id, codes.AlreadyExists, "generate request id %q was already used for a different request: every request needs its own id", id))
				continue
			}
			for _, c := range e.got {
				if c != nil {
					sess.push(c, nil)
				}
			}
			if e.state != stateEnded {
				e.subs[sess] = struct{}{}
				sess.subs[id] = e
			}
			continue
		}
		n := max(int(r.GetN()), 1)
		e := &genEntry{
			id:      id,
			fp:      fps[i],
			req:     enginepb.DecodeGenerateRequest(r),
			version: vers[i],
			adapter: r.GetAdapter(),
			n:       n,
			got:     make([]*enginepb.Completion, n),
			state:   stateQueued,
			subs:    map[*session]struct{}{sess: {}},
		}
		sess.subs[id] = e
		g.entries[id] = e
		g.queue = append(g.queue, e)
		g.queued += n
	}
	g.schedule()
}

// cancel stops waiting for ids on sess. A request nobody waits for any more is dropped if it has
// not started, and its batch is cancelled if nobody waits for any request in it.
func (g *generator) cancel(sess *session, ids []string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, id := range ids {
		e, ok := sess.subs[id]
		if !ok {
			continue
		}
		delete(sess.subs, id)
		delete(e.subs, sess)
		if len(e.subs) > 0 {
			continue
		}
		switch e.state {
		case stateQueued:
			g.queue = slices.DeleteFunc(g.queue, func(q *genEntry) bool { return q == e })
			g.queued -= e.n
			e.state = stateEnded
			if g.entries[id] == e {
				delete(g.entries, id)
			}
		case stateRunning:
			if !slices.ContainsFunc(e.batch.entries, func(o *genEntry) bool { return len(o.subs) > 0 }) {
				e.batch.cancel()
			}
		}
	}
}

// leave forgets sess, whose stream ended. Its requests go on: the client is expected to resend
// them on a new stream, and then they are answered from the entries.
func (g *generator) leave(sess *session) {
	g.mu.Lock()
	defer g.mu.Unlock()
	sess.closed = true
	for _, e := range sess.subs {
		delete(e.subs, sess)
	}
	clear(sess.subs)
}

func (g *generator) waiting(sess *session) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(sess.subs)
}

// schedule starts engine calls for the queue while there is room. g.mu is held.
func (g *generator) schedule() {
	if len(g.queue) == 0 {
		g.ready = false
		return
	}
	full := g.opts.MaxBatchSamples > 0 && g.queued >= g.opts.MaxBatchSamples
	if g.opts.BatchWindow > 0 && !g.ready && !full {
		if g.timer == nil {
			g.timer = time.AfterFunc(g.opts.BatchWindow, func() {
				g.mu.Lock()
				defer g.mu.Unlock()
				g.timer, g.ready = nil, true
				g.schedule()
			})
		}
		return
	}
	for g.running < g.opts.MaxConcurrentBatches && len(g.queue) > 0 {
		// A batch is one engine call, so its requests share the weights that sample them: the
		// oldest request's version, and the queued requests of that version after it in order.
		v := g.queue[0].version
		var take, rest []*genEntry
		samples, full := 0, false
		for _, e := range g.queue {
			if full || !sameVersion(e.version, v) {
				rest = append(rest, e)
				continue
			}
			if len(take) > 0 && g.opts.MaxBatchSamples > 0 && samples+e.n > g.opts.MaxBatchSamples {
				full = true
				rest = append(rest, e)
				continue
			}
			samples += e.n
			take = append(take, e)
		}
		ctx, cancel := context.WithCancel(context.Background())
		b := &batch{cancel: cancel, entries: take}
		g.queue = rest
		g.queued -= samples
		for _, e := range b.entries {
			e.state, e.batch = stateRunning, b
		}
		g.running++
		go g.run(ctx, b)
	}
	if len(g.queue) == 0 {
		g.ready = false
	}
}

// run makes one engine call for b and settles every request in it.
func (g *generator) run(ctx context.Context, b *batch) {
	defer func() {
		b.cancel()
		g.mu.Lock()
		g.running--
		g.schedule()
		g.mu.Unlock()
	}()
	err := g.generate(ctx, b.entries)
	if err != nil && len(b.entries) > 1 && ctx.Err() == nil && !errors.Is(err, engines.ErrVersionNotKept) {
		// One bad request must not fail the unrelated requests that happened to share its
		// batch: retry the unfinished ones alone, so the error lands on the one that caused it.
		// (A weights version the engine does not keep fails every request of the batch alike.)
		g.opts.Logf("engine server: a batch of %d generate requests failed (%v); retrying them one by one", len(b.entries), err)
		for _, e := range b.entries {
			if g.unfinished(e) {
				if err := g.generate(ctx, []*genEntry{e}); err != nil {
					g.fail(e, err)
				}
			}
		}
	} else if err != nil {
		for _, e := range b.entries {
			g.fail(e, err)
		}
	}
	for _, e := range b.entries {
		if g.unfinished(e) {
			g.fail(e, status.Errorf(codes.Internal, "the engine returned %d of the %d completions of request %q", g.samplesGot(e), e.n, e.id))
		}
	}
}

// generate calls the engine for entries and delivers what it returns.
func (g *generator) generate(ctx context.Context, entries []*genEntry) (err error) {
	defer func() {
		if r := recover(); r != nil {
			g.opts.Logf("engine server: the engine panicked in Generate: %v\n%s", r, debug.Stack())
			err = status.Errorf(codes.Internal, "the engine panicked: %v", r)
		}
	}()
	reqs := make([]engines.GenerateRequest, len(entries))
	var adapters []string // the entries' adapters when one names any
	for i, e := range entries {
		reqs[i] = e.req
		if e.adapter != "" && adapters == nil {
			adapters = make([]string, len(entries))
		}
	}
	if adapters != nil {
		// One engine call mixes the adapters (engines.AdapterGenerator), as the host's own
		// batches of the LoRA policies on one base do.
		for i, e := range entries {
			adapters[i] = e.adapter
		}
		comps, err := g.adapters.GenerateAdapters(ctx, reqs, adapters)
		if err != nil {
			return err
		}
		return g.deliverAll(entries, comps)
	}
	var comps []engines.Completion
	if v := entries[0].version; v != nil {
		// A kept version samples the whole batch at once (engines.Versions has no streaming
		// form); schedule put only requests of this version into it.
		vs, err := g.keeper(ctx)
		if err != nil {
			return err
		}
		if comps, err = vs.GenerateVersion(ctx, *v, reqs); err != nil {
			return fmt.Errorf("generate from weights version %d: %w", *v, err)
		}
		return g.deliverAll(entries, comps)
	}
	if g.stream != nil {
		byID := make(map[string]*genEntry, len(entries))
		for _, e := range entries {
			byID[e.id] = e
		}
		return g.stream.GenerateStream(ctx, reqs, func(c engines.Completion) {
			if e := byID[c.RequestID]; e != nil {
				g.deliver(e, c.Index, c)
			}
		})
	}
	comps, err = g.eng.Generate(ctx, reqs)
	if err != nil {
		return err
	}
	return g.deliverAll(entries, comps)
}

// deliverAll delivers the completions of one engine call for entries, which answers request by
// request in order.
func (g *generator) deliverAll(entries []*genEntry, comps []engines.Completion) error {
	total := 0
	for _, e := range entries {
		total += e.n
	}
	if len(comps) != total {
		return status.Errorf(codes.Internal, "the engine returned %d completions for %d samples", len(comps), total)
	}
	// Engine.Generate answers request by request in order, so position says which is which.
	k := 0
	for _, e := range entries {
		for i := range e.n {
			g.deliver(e, i, comps[k])
			k++
		}
	}
	return nil
}

// deliver records sample index of e and passes it to the streams waiting for e.
func (g *generator) deliver(e *genEntry, index int, c engines.Completion) {
	pc := enginepb.EncodeCompletion(c)
	pc.RequestId, pc.Index = e.id, int32(index)
	if size := proto.Size(pc); size > g.opts.MaxMessageBytes-1024 {
		g.fail(e, status.Errorf(codes.ResourceExhausted,
			"completion %d of request %q is %d bytes, over the engine server's message limit of %d bytes: "+
				"raise --max-message-mb on the server and the client's engine.max_message_mb",
			index, e.id, size, g.opts.MaxMessageBytes))
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if e.state == stateEnded || index < 0 || index >= e.n || e.got[index] != nil {
		return
	}
	e.got[index] = pc
	e.ngot++
	e.bytes += proto.Size(pc)
	for s := range e.subs {
		s.push(pc, nil)
	}
	if e.ngot == e.n {
		e.state, e.batch, e.req = stateEnded, nil, engines.GenerateRequest{}
		e.finishedAt = time.Now()
		g.unsubscribeAll(e)
		g.finished = append(g.finished, e)
		g.kept += e.bytes
		g.evict(e.finishedAt)
	}
}

// fail ends e with err and forgets its id, so that a resend tries again.
func (g *generator) fail(e *genEntry, err error) {
	st := status.Convert(toStatus(err))
	g.mu.Lock()
	defer g.mu.Unlock()
	if e.state == stateEnded {
		return
	}
	e.state, e.batch = stateEnded, nil
	if g.entries[e.id] == e {
		delete(g.entries, e.id)
	}
	for s := range e.subs {
		s.push(nil, &enginepb.RequestError{RequestId: e.id, Code: int32(st.Code()), Message: st.Message()})
	}
	g.unsubscribeAll(e)
}

func (g *generator) unsubscribeAll(e *genEntry) {
	for s := range e.subs {
		delete(s.subs, e.id)
	}
	e.subs = nil
}

func (g *generator) unfinished(e *genEntry) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return e.state != stateEnded
}

func (g *generator) samplesGot(e *genEntry) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return e.ngot
}

// evict forgets finished requests older than DedupWindow, and the oldest ones while their
// completions take more than DedupMaxBytes. g.mu is held.
func (g *generator) evict(now time.Time) {
	i := 0
	for i < len(g.finished) {
		f := g.finished[i]
		if now.Sub(f.finishedAt) < g.opts.DedupWindow && g.kept <= g.opts.DedupMaxBytes {
			break
		}
		if g.entries[f.id] == f {
			delete(g.entries, f.id)
		}
		g.kept -= f.bytes
		i++
	}
	g.finished = slices.Delete(g.finished, 0, i)
}

// sameVersion says whether two requests are sampled by the same weights.
func sameVersion(a, b *int) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}

// forgetVersion drops the finished requests sampled from kept version v (KeepVersion replaced
// it), so that a resend is sampled from the weights now kept as v.
func (g *generator) forgetVersion(v int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.finished = slices.DeleteFunc(g.finished, func(f *genEntry) bool {
		if f.version == nil || *f.version != v {
			return false
		}
		if g.entries[f.id] == f {
			delete(g.entries, f.id)
		}
		g.kept -= f.bytes
		return true
	})
}

// forgetFinished drops every finished request (Load replaced the weights they were sampled from).
func (g *generator) forgetFinished() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, f := range g.finished {
		if g.entries[f.id] == f {
			delete(g.entries, f.id)
		}
	}
	g.finished, g.kept = nil, 0
}
