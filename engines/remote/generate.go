package remote

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Generate samples the completions of reqs on the remote engine. The requests go out on the
// client's shared stream at once and the call returns when all their completions are back. A
// request without an ID gets a random one; a request keeps its ID through every resend.
func (c *Client) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	if err := c.brokenErr(); err != nil {
		return nil, fmt.Errorf("engine at %s: generate: %w", c.addr, err)
	}
	calls := make([]*genCall, len(reqs))
	seen := make(map[string]bool, len(reqs))
	total := 0
	for i, r := range reqs {
		if r.ID == "" {
			r.ID = "gen-" + newID()
		}
		if seen[r.ID] {
			return nil, fmt.Errorf("engine at %s: generate: request id %q appears twice in one call; every request needs its own id", c.addr, r.ID)
		}
		seen[r.ID] = true
		if r.N < 0 {
			return nil, fmt.Errorf("engine at %s: generate: request %q asks for n = %d samples; n must be ≥ 0 (0 is read as 1)", c.addr, r.ID, r.N)
		}
		msg := enginepb.EncodeGenerateRequest(r)
		// A stream message carries at least one request; leave room for its framing.
		if err := c.checkSize(fmt.Sprintf("generate request %q", r.ID), &enginepb.GenerateStreamRequest{Requests: []*enginepb.GenerateRequest{msg}}); err != nil {
			return nil, err
		}
		n := max(r.N, 1)
		total += n
		calls[i] = &genCall{id: r.ID, n: n, msg: msg, comps: make([]engines.Completion, n), have: make([]bool, n), done: make(chan struct{})}
	}
	ctx, cancel := c.deadline(ctx)
	defer cancel()
	if err := c.gen.add(calls); err != nil {
		return nil, err
	}
	for _, call := range calls {
		select {
		case <-call.done:
			if call.err != nil {
				c.gen.drop(calls)
				return nil, call.err
			}
		case <-ctx.Done():
			c.gen.drop(calls)
			return nil, c.gen.timeoutError(ctx, calls)
		}
	}
	out := make([]engines.Completion, 0, total)
	for _, call := range calls {
		out = append(out, call.comps...)
	}
	return out, nil
}

// genCall is one request waiting for its completions.
type genCall struct {
	id   string
	seq  uint64 // order of submission, kept when resending
	n    int
	msg  *enginepb.GenerateRequest
	done chan struct{} // closed when comps are all there or err is set

	// Guarded by mux.mu until done is closed.
	comps []engines.Completion
	have  []bool
	ngot  int
	err   error
}

// mux runs the client's one Generate stream: it sends the requests of all callers, routes each
// completion back to its caller, and when the stream breaks it opens a new one and resends every
// request still waiting. The stream stays open between calls.
type mux struct {
	c *Client

	mu      sync.Mutex
	calls   map[string]*genCall // waiting, by id
	seq     uint64
	st      *stream // the open stream; nil while (re)connecting
	running bool    // the run loop is alive
	closed  bool
	out     outage // the stream's current outage
}

type stream struct {
	s      enginepb.Engine_GenerateClient
	sendMu sync.Mutex // a gRPC stream takes one sender at a time
}

func newMux(c *Client) *mux {
	return &mux{c: c, calls: map[string]*genCall{}}
}

func (st *stream) send(msgs []*enginepb.GenerateStreamRequest) error {
	st.sendMu.Lock()
	defer st.sendMu.Unlock()
	for _, m := range msgs {
		if err := st.s.Send(m); err != nil {
			return err
		}
	}
	return nil
}

// pack groups requests into stream messages of at most half the message limit, so that a
// call's requests arrive together (and are batched together) without any message being refused.
func (m *mux) pack(reqs []*enginepb.GenerateRequest) []*enginepb.GenerateStreamRequest {
	limit := m.c.opts.MaxMessageBytes / 2
	var out []*enginepb.GenerateStreamRequest
	cur, size := &enginepb.GenerateStreamRequest{}, 0
	for _, r := range reqs {
		rs := proto.Size(r) + 8 // field tag and length
		if len(cur.Requests) > 0 && size+rs > limit {
			out = append(out, cur)
			cur, size = &enginepb.GenerateStreamRequest{}, 0
		}
		cur.Requests = append(cur.Requests, r)
		size += rs
	}
	return append(out, cur)
}

// add registers calls and sends them on the open stream, or starts the loop that opens one.
func (m *mux) add(calls []*genCall) error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return fmt.Errorf("engine at %s: generate: %w", m.c.addr, ErrClosed)
	}
	for _, call := range calls {
		if _, busy := m.calls[call.id]; busy {
			m.mu.Unlock()
			return fmt.Errorf("engine at %s: generate: request id %q is already waiting for an answer; every request needs its own id", m.c.addr, call.id)
		}
	}
	reqs := make([]*enginepb.GenerateRequest, len(calls))
	for i, call := range calls {
		m.seq++
		call.seq = m.seq
		m.calls[call.id] = call
		reqs[i] = call.msg
	}
	st := m.st
	if !m.running {
		m.running = true
		go m.run()
	}
	m.mu.Unlock()
	if st != nil {
		// A failed send means a broken stream: the run loop sees it too and resends.
		_ = st.send(m.pack(reqs))
	}
	return nil
}

// drop stops waiting for calls (their caller gave up) and tells the server, which then spends no
// more work on those that have not started.
func (m *mux) drop(calls []*genCall) {
	m.mu.Lock()
	var ids []string
	for _, call := range calls {
		if m.calls[call.id] == call {
			delete(m.calls, call.id)
			ids = append(ids, call.id)
		}
	}
	st := m.st
	m.mu.Unlock()
	if st != nil && len(ids) > 0 {
		go func() { _ = st.send([]*enginepb.GenerateStreamRequest{{Cancel: ids}}) }()
	}
}

// run keeps a stream open while calls wait, reconnecting with backoff; it ends when no call
// waits and the stream has broken, or when the client is closed.
func (m *mux) run() {
	for {
		m.mu.Lock()
		if len(m.calls) == 0 || m.closed {
			m.running = false
			m.mu.Unlock()
			return
		}
		m.mu.Unlock()
		err := m.session()
		if m.c.ctx.Err() != nil {
			continue // closed: the loop ends above
		}
		var refused *restartError
		if errors.As(err, &refused) {
			m.failAll(fmt.Errorf("engine at %s: generate: %w", m.c.addr, err))
			continue
		}
		if !reconnectable(err) {
			m.failAll(m.c.callError(context.Background(), "generate", err, nil))
			continue
		}
		m.mu.Lock()
		wait, ok := m.out.next(err, m.c.opts)
		var gaveUp error
		if !ok {
			gaveUp = m.c.callError(context.Background(), "generate", err, &m.out)
			m.out.reset()
		}
		m.mu.Unlock()
		if gaveUp != nil {
			m.failAll(gaveUp)
			continue
		}
		sleep(m.c.ctx, wait)
	}
}

// session opens a stream, resends every waiting request on it and routes what comes back until
// the stream breaks; it returns why it broke. Nothing is resent before the client knows which
// server process answers: a new one is restored (OnRestart) before it sees any request. A server
// that names itself in its headers sends the stream's header at once, so the client reads it
// before sending; of one that does not, the client asks Health after an outage.
func (m *mux) session() error {
	ctx, cancel := context.WithCancel(m.c.ctx)
	defer cancel()
	m.mu.Lock()
	recovered := m.out.began()
	m.mu.Unlock()
	named := m.c.named.Load()
	if recovered && !named {
		if err := m.c.confirm(ctx); err != nil {
			return err
		}
	}
	s, err := m.c.rpc.Generate(ctx)
	if err != nil {
		return err
	}
	if named {
		// The header proves the engine is back (it comes after the token check) and names it.
		header, err := s.Header()
		if err != nil {
			return err
		}
		if err := m.c.sawInstance(firstValue(header, enginepb.InstanceHeader)); err != nil {
			return err
		}
	}
	st := &stream{s: s}
	m.mu.Lock()
	if named || recovered { // the engine answered: the header, or Health above
		m.out.reset()
	}
	m.st = st
	waiting := make([]*genCall, 0, len(m.calls))
	for _, call := range m.calls {
		waiting = append(waiting, call)
	}
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		if m.st == st {
			m.st = nil
		}
		m.mu.Unlock()
	}()
	if len(waiting) > 0 {
		slices.SortFunc(waiting, func(a, b *genCall) int { return cmp.Compare(a.seq, b.seq) })
		reqs := make([]*enginepb.GenerateRequest, len(waiting))
		for i, call := range waiting {
			reqs[i] = call.msg
		}
		_ = st.send(m.pack(reqs)) // on failure Header or Recv below says why
	}
	if !named {
		if _, err := s.Header(); err != nil {
			return err
		}
		m.mu.Lock()
		m.out.reset()
		m.mu.Unlock()
	}
	for {
		resp, err := s.Recv()
		if err != nil {
			return err
		}
		m.receive(resp)
	}
}

// receive routes completions and request errors to their calls. A completion already received
// (a resent request answered twice) is ignored.
func (m *mux) receive(resp *enginepb.GenerateStreamResponse) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, pc := range resp.GetCompletions() {
		call := m.calls[pc.GetRequestId()]
		i := int(pc.GetIndex())
		if call == nil || i < 0 || i >= call.n || call.have[i] {
			continue
		}
		call.comps[i] = enginepb.DecodeCompletion(pc)
		call.have[i] = true
		call.ngot++
		if call.ngot == call.n {
			delete(m.calls, call.id)
			close(call.done)
		}
	}
	for _, e := range resp.GetErrors() {
		call := m.calls[e.GetRequestId()]
		if call == nil {
			continue
		}
		delete(m.calls, call.id)
		st := status.New(codes.Code(e.GetCode()), e.GetMessage())
		call.err = m.c.callError(context.Background(), fmt.Sprintf("generate request %q", call.id), st.Err(), nil)
		close(call.done)
	}
}

// failAll ends every waiting call with err.
func (m *mux) failAll(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, call := range m.calls {
		call.err = err
		close(call.done)
		delete(m.calls, id)
	}
}

func (m *mux) close() {
	m.mu.Lock()
	m.closed = true
	m.mu.Unlock()
	m.failAll(fmt.Errorf("engine at %s: generate: %w", m.c.addr, ErrClosed))
}

// timeoutError says how much of calls was still unanswered at the deadline, and whether the
// engine was unreachable at the time.
func (m *mux) timeoutError(ctx context.Context, calls []*genCall) error {
	m.mu.Lock()
	out := m.out
	m.mu.Unlock()
	open := 0
	for _, call := range calls {
		select {
		case <-call.done:
		default:
			open++
		}
	}
	return m.c.deadlineError(fmt.Sprintf("generate (%d of %d requests unanswered)", open, len(calls)), ctx.Err(), &out)
}

// reconnectable reports whether a broken stream is worth opening again: the server went away or
// is restarting, as opposed to refusing the client.
func reconnectable(err error) bool {
	if errors.Is(err, io.EOF) {
		return true // the server ended the stream, e.g. on shutdown
	}
	st := status.Convert(err)
	switch st.Code() {
	case codes.Unavailable:
		return !permanent(st.Message())
	case codes.Aborted, codes.Canceled:
		return true // Canceled is not ours: the run loop checks the client's own context first
	}
	return false
}
