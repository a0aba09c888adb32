// Package remote is an engines.Engine that talks to a policy engine in another process or on
// another machine over the slimen engine protocol (engines/proto): `slimen serve`, the PyTorch
// worker of engines/torch, or anything else that serves the protocol.
//
// Every call has a deadline (the caller's, else Options.Timeout). A call that finds the engine
// unreachable is retried with exponential backoff for up to Options.ReconnectTimeout, with the
// same request ids: the server answers a resent generate request or optimizer step once, so a
// retry never doubles a sample or a step. Generate multiplexes all callers over one long-lived
// stream and resends the requests in flight when the stream has to be re-established.
//
// A server that comes back as a new process (its instance id changed) has lost every state it had
// not saved. The client notices before it trusts anything that process says — from the instance
// in every answer's header, or from a Health call before resending after an outage — and runs
// Options.OnRestart first, so that its caller can put the state back (Load a checkpoint) before
// any request in flight is answered by the new process.
package remote

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Defaults for the zero fields of Options.
const (
	DefaultMaxMessageBytes  = 64 << 20
	DefaultTimeout          = 10 * time.Minute
	DefaultReconnectTimeout = 2 * time.Minute
	DefaultMaxBackoff       = 2 * time.Second
)

// ErrUnavailable is wrapped by the error of a call that gave up because the engine stayed
// unreachable for Options.ReconnectTimeout.
var ErrUnavailable = errors.New("engine unavailable")

// ErrClosed is returned by calls on a closed Client.
var ErrClosed = errors.New("engine client closed")

// TLS holds the client's TLS settings.
type TLS struct {
	CAFile     string // PEM bundle of the CAs that sign the server's certificate; empty: the system's
	CertFile   string // client certificate for mutual TLS (with KeyFile); optional
	KeyFile    string
	ServerName string // name checked against the server's certificate; empty: the address's host
}

// Options say where the engine is and how to talk to it.
type Options struct {
	Address string // host:port
	// TLS, when set, encrypts the connection and checks the server's certificate.
	TLS *TLS
	// Insecure allows plaintext to a non-loopback address (a private network, or a proxy that
	// adds TLS). Without it such an address needs TLS.
	Insecure bool
	// TokenEnv names the environment variable holding the bearer token; empty: no token.
	TokenEnv string
	// Token is the bearer token itself, for a caller that holds it rather than an environment
	// variable (engines/torchproc makes one per worker). Set TokenEnv or Token, not both.
	Token string
	// MaxMessageBytes bounds every message in both directions; 0: DefaultMaxMessageBytes.
	MaxMessageBytes int
	// Timeout is the deadline of a call whose context has none; 0: DefaultTimeout.
	Timeout time.Duration
	// ReconnectTimeout is how long a call waits for an unreachable engine to come back before it
	// fails with ErrUnavailable; 0: DefaultReconnectTimeout.
	ReconnectTimeout time.Duration
	// MaxBackoff caps the wait between reconnection attempts; 0: DefaultMaxBackoff.
	MaxBackoff time.Duration
	// OnRestart, when set, is called when the client finds a server process other than the one
	// it talked to before: that engine lost every state it had not saved. It runs before anything
	// the new process answers is trusted: requests in flight are resent to it, and calls go on,
	// only once OnRestart has returned, so it can put the lost state back (Load a checkpoint,
	// replay optimizer steps) through this client with the ctx it is given; calls made with that
	// ctx go straight through. Calls that meet the new process meanwhile wait for it. An answer
	// the new process gave before OnRestart ran is not used: the call is made again (a train step
	// too: Load makes the server forget the step ids it applied).
	//
	// An error from OnRestart means the engine cannot be used any more: the call that found the
	// new process, and every later call of this client, fails with an error wrapping it.
	OnRestart func(ctx context.Context, previous, current string) error
}

// restoring marks the context of OnRestart: the calls it makes are part of putting the state back.
type restoring struct{}

// restartError is OnRestart's refusal of a new server process.
type restartError struct{ err error }

func (e *restartError) Error() string { return e.err.Error() }
func (e *restartError) Unwrap() error { return e.err }

// Client is an engines.Engine served by a remote engine server. It is safe for concurrent use.
type Client struct {
	addr     string
	opts     Options
	tokenEnv string
	conn     *grpc.ClientConn
	rpc      enginepb.EngineClient
	gen      *mux

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc

	// restartMu is held while a new server process is checked and OnRestart runs for it.
	restartMu sync.Mutex
	// named is set once an answer's header has named the server process (enginepb.InstanceHeader):
	// such a server sends the Generate stream's header at once, before any completion.
	named atomic.Bool
	// versions is set once KeepsVersions found "versions" in the server's capabilities.
	versions atomic.Bool
	// giveUp, when not 0, is when calls stop waiting for an unreachable engine (GiveUpAt), in
	// Unix nanoseconds.
	giveUp atomic.Int64

	mu       sync.Mutex
	instance string // the server process the client trusts: seen at Dial, or accepted by OnRestart
	restores uint64 // how many times OnRestart has accepted a new process
	broken   error  // OnRestart refused a new process: every call fails with this
}

var (
	_ engines.Engine   = (*Client)(nil)
	_ engines.Renderer = (*Client)(nil)
)

// Dial connects to the engine at opts.Address and checks that it answers, speaks this protocol
// version and accepts the token. It waits for an engine that is starting up for as long as ctx
// and opts.ReconnectTimeout allow.
func Dial(ctx context.Context, opts Options) (*Client, error) {
	if opts.MaxMessageBytes <= 0 {
		opts.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.ReconnectTimeout <= 0 {
		opts.ReconnectTimeout = DefaultReconnectTimeout
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = DefaultMaxBackoff
	}
	addr := opts.Address
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("engine address %q: %v; write it as host:port, e.g. 127.0.0.1:7777", addr, err)
	}
	creds, err := transportCredentials(opts)
	if err != nil {
		return nil, err
	}
	dopts := []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(opts.MaxMessageBytes),
			grpc.MaxCallSendMsgSize(opts.MaxMessageBytes),
		),
		// gRPC's own reconnection backs off up to 2 minutes by default; a restarted engine should
		// be found within MaxBackoff.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 2, Jitter: 0.2, MaxDelay: opts.MaxBackoff},
			MinConnectTimeout: 10 * time.Second,
		}),
		// Pings find a server that vanished without closing the connection (a dead machine, a
		// dropped route) while a long generate call waits.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 20 * time.Second, PermitWithoutStream: true}),
	}
	tok := opts.Token
	if opts.TokenEnv != "" {
		if tok != "" {
			return nil, fmt.Errorf("engine at %s: both a token and a token environment variable (%s) given; set one", addr, opts.TokenEnv)
		}
		if tok = os.Getenv(opts.TokenEnv); tok == "" {
			return nil, fmt.Errorf("engine at %s: the token environment variable %s (engine.token_env) is empty or unset: "+
				"export the server's token in it", addr, opts.TokenEnv)
		}
	}
	if tok != "" {
		dopts = append(dopts, grpc.WithPerRPCCredentials(bearer(tok)))
	}
	// passthrough: the name is resolved again at each connection attempt, so an engine that
	// comes back on another IP under the same name is found.
	conn, err := grpc.NewClient("passthrough:///"+addr, dopts...)
	if err != nil {
		return nil, fmt.Errorf("engine at %s: %w", addr, err)
	}
	c := &Client{addr: addr, opts: opts, tokenEnv: opts.TokenEnv, conn: conn, rpc: enginepb.NewEngineClient(conn)}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.gen = newMux(c)
	h, err := c.Health(ctx)
	if err != nil {
		c.Close()
		return nil, err
	}
	c.mu.Lock()
	c.instance = h.Instance
	c.mu.Unlock()
	return c, nil
}

// Address is the engine's host:port.
func (c *Client) Address() string { return c.addr }

// GiveUpAt makes the client stop waiting for an unreachable engine at t, whatever
// ReconnectTimeout says: a call that finds the engine unreachable fails with ErrUnavailable at t
// (at once after it) instead of retrying on. An engine that answers is not affected. A host that
// is stopping sets it to the end of its stop grace, so that a dead server cannot hold up its
// exit. The earliest t given holds.
func (c *Client) GiveUpAt(t time.Time) {
	n := t.UnixNano()
	for {
		old := c.giveUp.Load()
		if old != 0 && old <= n || c.giveUp.CompareAndSwap(old, n) {
			return
		}
	}
}

// gaveUpAt is the time GiveUpAt set; zero if none.
func (c *Client) gaveUpAt() time.Time {
	if n := c.giveUp.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Health is what an engine server says about itself.
type Health struct {
	Serving         bool
	ProtocolVersion uint32
	Instance        string // random per server process start
}

// Health asks the server whether it is up; it retries while the engine is unreachable, like every
// call.
func (c *Client) Health(ctx context.Context) (Health, error) {
	var resp *enginepb.HealthResponse
	err := c.call(ctx, "health", &enginepb.HealthRequest{}, func(ctx context.Context, o ...grpc.CallOption) (err error) {
		resp, err = c.rpc.Health(ctx, &enginepb.HealthRequest{}, o...)
		return err
	})
	if err != nil {
		return Health{}, err
	}
	h := Health{
		Serving:         resp.GetStatus() == enginepb.HealthResponse_SERVING,
		ProtocolVersion: resp.GetProtocolVersion(),
		Instance:        resp.GetInstance(),
	}
	if h.ProtocolVersion != enginepb.ProtocolVersion {
		return h, fmt.Errorf("engine at %s speaks engine protocol version %d and this slimen version %d: "+
			"run the same slimen release (or a worker built for it) on both sides",
			c.addr, h.ProtocolVersion, enginepb.ProtocolVersion)
	}
	return h, nil
}

// Instance is the server process the client talked to last.
func (c *Client) Instance() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.instance
}

// confirm asks which server process answers now, after an outage and before anything is resent
// to it: a new process is checked by sawInstance (and so restored) first. An error means the
// engine is still unreachable, or OnRestart refused it (a *restartError).
func (c *Client) confirm(ctx context.Context) error {
	resp, err := c.rpc.Health(ctx, &enginepb.HealthRequest{})
	if err != nil {
		return err
	}
	return c.sawInstance(resp.GetInstance())
}

// sawInstance checks the server process an answer came from. A process other than the trusted
// one is handed to OnRestart (once, however many calls meet it; the others wait) and trusted if
// OnRestart accepts it.
func (c *Client) sawInstance(instance string) error {
	c.mu.Lock()
	if c.instance == "" { // the first answer, at Dial
		c.instance = instance
	}
	same, broken := instance == "" || instance == c.instance, c.broken
	c.mu.Unlock()
	if broken != nil {
		return broken
	}
	if same {
		return nil
	}
	c.restartMu.Lock()
	defer c.restartMu.Unlock()
	c.mu.Lock()
	prev, broken := c.instance, c.broken
	c.mu.Unlock()
	if broken != nil {
		return broken
	}
	if prev == instance {
		return nil // another call met it first, and OnRestart accepted it
	}
	if c.opts.OnRestart != nil {
		// OnRestart's calls are not bound to the deadline of the call that happened to meet the
		// new process: putting the state back must not be cut short halfway.
		ctx := context.WithValue(c.ctx, restoring{}, true)
		if err := c.opts.OnRestart(ctx, prev, instance); err != nil {
			err = &restartError{fmt.Errorf("the engine restarted as a new process (instance %s → %s) and cannot be used: %w", prev, instance, err)}
			c.mu.Lock()
			c.broken = err
			c.mu.Unlock()
			return err
		}
	}
	c.mu.Lock()
	c.instance = instance
	c.restores++
	c.mu.Unlock()
	return nil
}

// restoreCount is how many new server processes OnRestart has accepted so far.
func (c *Client) restoreCount() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.restores
}

// brokenErr is OnRestart's refusal, if any.
func (c *Client) brokenErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.broken
}

// Info describes the remote engine's model.
func (c *Client) Info(ctx context.Context) (engines.Info, error) {
	req := &enginepb.InfoRequest{ProtocolVersion: enginepb.ProtocolVersion}
	var resp *enginepb.InfoResponse
	err := c.call(ctx, "info", req, func(ctx context.Context, o ...grpc.CallOption) (err error) {
		resp, err = c.rpc.Info(ctx, req, o...)
		return err
	})
	if err != nil {
		return engines.Info{}, err
	}
	return enginepb.DecodeInfo(resp.GetInfo()), nil
}

// Score returns the log-probabilities of each request's response tokens.
func (c *Client) Score(ctx context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	return c.score(ctx, reqs, "", nil)
}

// score scores with the LoRA adapter named adapter ("" the model itself), with kept weights
// version *version when that is set (ScoreVersion).
func (c *Client) score(ctx context.Context, reqs []engines.ScoreRequest, adapter string, version *int32) ([]engines.Scores, error) {
	req := &enginepb.ScoreBatchRequest{Requests: make([]*enginepb.ScoreRequest, len(reqs)), Version: version}
	for i, r := range reqs {
		req.Requests[i] = enginepb.EncodeScoreRequest(r)
		req.Requests[i].Adapter = adapter
	}
	var resp *enginepb.ScoreBatchResponse
	err := c.call(ctx, "score", req, func(ctx context.Context, o ...grpc.CallOption) (err error) {
		resp, err = c.rpc.Score(ctx, req, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(resp.GetScores()) != len(reqs) {
		return nil, fmt.Errorf("engine at %s: score: %d results for %d requests", c.addr, len(resp.GetScores()), len(reqs))
	}
	out := make([]engines.Scores, len(reqs))
	for i, s := range resp.GetScores() {
		out[i] = engines.Scores{Logprobs: s.GetLogprobs()}
	}
	return out, nil
}

// Values asks a critic engine for the value of each response token (engines.Valuer).
func (c *Client) Values(ctx context.Context, reqs []engines.ScoreRequest) ([][]float32, error) {
	req := &enginepb.ScoreBatchRequest{Requests: make([]*enginepb.ScoreRequest, len(reqs))}
	for i, r := range reqs {
		req.Requests[i] = enginepb.EncodeScoreRequest(r)
	}
	var resp *enginepb.ValuesResponse
	err := c.call(ctx, "values", req, func(ctx context.Context, o ...grpc.CallOption) (err error) {
		resp, err = c.rpc.Values(ctx, req, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(resp.GetValues()) != len(reqs) {
		return nil, fmt.Errorf("engine at %s: values: %d results for %d requests", c.addr, len(resp.GetValues()), len(reqs))
	}
	out := make([][]float32, len(reqs))
	for i, v := range resp.GetValues() {
		out[i] = v.GetLogprobs()
	}
	return out, nil
}

// Train runs one optimizer step. The step carries b.ID (a random one when b.ID is empty) and is
// resent with it while the engine is unreachable; the server applies an id at most once.
func (c *Client) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	return c.train(ctx, b, "")
}

// train trains the LoRA adapter named adapter ("" the model's full weights).
func (c *Client) train(ctx context.Context, b engines.Batch, adapter string) (engines.TrainStats, error) {
	if b.ID == "" {
		b.ID = "step-" + newID()
	}
	req := &enginepb.TrainRequest{Batch: enginepb.EncodeBatch(b), Adapter: adapter}
	var resp *enginepb.TrainResponse
	err := c.call(ctx, "train", req, func(ctx context.Context, o ...grpc.CallOption) (err error) {
		resp, err = c.rpc.Train(ctx, req, o...)
		return err
	})
	if err != nil {
		return engines.TrainStats{}, err
	}
	return enginepb.DecodeTrainStats(resp.GetStats()), nil
}

// Render applies the engine's chat template (engines.Renderer).
func (c *Client) Render(ctx context.Context, reqs []engines.RenderRequest) ([][]int32, error) {
	req := &enginepb.RenderBatchRequest{Requests: make([]*enginepb.RenderRequest, len(reqs))}
	for i, r := range reqs {
		req.Requests[i] = enginepb.EncodeRenderRequest(r)
	}
	var resp *enginepb.RenderResponse
	err := c.call(ctx, "render", req, func(ctx context.Context, o ...grpc.CallOption) (err error) {
		resp, err = c.rpc.Render(ctx, req, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(resp.GetTokens()) != len(reqs) {
		return nil, fmt.Errorf("engine at %s: render: %d results for %d requests", c.addr, len(resp.GetTokens()), len(reqs))
	}
	out := make([][]int32, len(reqs))
	for i, t := range resp.GetTokens() {
		out[i] = t.GetIds()
	}
	return out, nil
}

// Tokenize turns raw text into token ids.
func (c *Client) Tokenize(ctx context.Context, texts []string) ([][]int32, error) {
	req := &enginepb.TokenizeRequest{Texts: texts}
	var resp *enginepb.TokenizeResponse
	err := c.call(ctx, "tokenize", req, func(ctx context.Context, o ...grpc.CallOption) (err error) {
		resp, err = c.rpc.Tokenize(ctx, req, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(resp.GetTokens()) != len(texts) {
		return nil, fmt.Errorf("engine at %s: tokenize: %d results for %d texts", c.addr, len(resp.GetTokens()), len(texts))
	}
	out := make([][]int32, len(texts))
	for i, t := range resp.GetTokens() {
		out[i] = t.GetIds()
	}
	return out, nil
}

// Save writes the model into dir, a path on the engine server's machine.
func (c *Client) Save(ctx context.Context, dir string) error {
	return c.save(ctx, nil, dir)
}

// save is Save, of kept weights version *version when it is set (SaveVersion).
func (c *Client) save(ctx context.Context, version *int32, dir string) error {
	req := &enginepb.SaveRequest{Dir: dir, Version: version}
	return c.call(ctx, "save", req, func(ctx context.Context, o ...grpc.CallOption) error {
		_, err := c.rpc.Save(ctx, req, o...)
		return err
	})
}

// Load replaces the model with the one in dir, a path on the engine server's machine.
func (c *Client) Load(ctx context.Context, dir string) error {
	req := &enginepb.LoadRequest{Dir: dir}
	return c.call(ctx, "load", req, func(ctx context.Context, o ...grpc.CallOption) error {
		_, err := c.rpc.Load(ctx, req, o...)
		return err
	})
}

// Close ends the connection; calls in flight fail with ErrClosed. The remote engine keeps running.
func (c *Client) Close() error {
	c.cancel()
	c.gen.close()
	return c.conn.Close()
}

// call runs one unary RPC under the call's deadline, retrying with backoff while the engine is
// unreachable. After an outage it confirms which server process answers before resending; an
// answer from a process the client does not trust yet is checked (and the state restored) first,
// and the call made again.
func (c *Client) call(ctx context.Context, method string, req proto.Message, rpc func(context.Context, ...grpc.CallOption) error) error {
	if err := c.checkSize(method, req); err != nil {
		return err
	}
	ctx, cancel := c.deadline(ctx)
	defer cancel()
	inRestore := ctx.Value(restoring{}) != nil
	var out outage
	for {
		if c.ctx.Err() != nil {
			return fmt.Errorf("engine at %s: %s: %w", c.addr, method, ErrClosed)
		}
		if err := c.brokenErr(); err != nil && !inRestore {
			return fmt.Errorf("engine at %s: %s: %w", c.addr, method, err)
		}
		if out.began() && !inRestore {
			if err := c.confirm(ctx); err != nil {
				var re *restartError
				if errors.As(err, &re) {
					return fmt.Errorf("engine at %s: %s: %w", c.addr, method, err)
				}
				if retry, failed := c.retry(ctx, method, err, &out); !retry {
					return failed
				}
				continue
			}
		}
		restores := c.restoreCount()
		var header metadata.MD
		err := rpc(ctx, grpc.Header(&header))
		if err == nil {
			if inRestore {
				return nil
			}
			instance := firstValue(header, enginepb.InstanceHeader)
			if instance != "" {
				c.named.Store(true)
			}
			if err := c.sawInstance(instance); err != nil {
				return fmt.Errorf("engine at %s: %s: %w", c.addr, method, err)
			}
			if c.restoreCount() != restores {
				// A new process was restored while this call ran: its answer may predate that.
				out.reset()
				continue
			}
			return nil
		}
		if retry, failed := c.retry(ctx, method, err, &out); !retry {
			// An error from a process other than the trusted one is no more to be trusted
			// than an answer (it may be a state that process lost: a kept weights version):
			// OnRestart first, then the call again.
			if instance := firstValue(header, enginepb.InstanceHeader); !inRestore && instance != "" && instance != c.Instance() {
				if err := c.sawInstance(instance); err != nil {
					return fmt.Errorf("engine at %s: %s: %w", c.addr, method, err)
				}
				out.reset()
				continue
			}
			return failed
		}
	}
}

// retry decides after a failed attempt whether to try again (after a backoff) or fail the call.
func (c *Client) retry(ctx context.Context, method string, err error, out *outage) (bool, error) {
	if st := status.Convert(err); st.Code() != codes.Unavailable || permanent(st.Message()) || ctx.Err() != nil {
		return false, c.callError(ctx, method, err, out)
	}
	if d, ok := out.next(err, c.opts, c.gaveUpAt()); !ok || !sleep(ctx, d) {
		return false, c.callError(ctx, method, err, out)
	}
	return true, nil
}

func firstValue(md metadata.MD, key string) string {
	if v := md.Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

// deadline gives ctx the default timeout unless it has a deadline already.
func (c *Client) deadline(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, c.opts.Timeout)
}

// checkSize refuses a request over the message limit before it is sent, with an error that says
// which limit to raise; gRPC's own error would not.
func (c *Client) checkSize(method string, req proto.Message) error {
	if size := proto.Size(req); size > c.opts.MaxMessageBytes {
		return fmt.Errorf("engine at %s: %s: the request is %s, over the message limit of %s: "+
			"send less per call (e.g. a smaller batch) or raise the limit on both sides "+
			"(engine.max_message_mb here, --max-message-mb on the server)",
			c.addr, method, mib(size), mib(c.opts.MaxMessageBytes))
	}
	return nil
}

func mib(n int) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// outage tracks one stretch of time in which the engine could not be reached.
type outage struct {
	since    time.Time
	attempts int
	last     error
}

func (o *outage) began() bool { return !o.since.IsZero() }

// next records a failed attempt and says how long to wait before the next one; ok is false once
// the outage has lasted ReconnectTimeout, or giveUp (when not zero) has come.
func (o *outage) next(err error, opts Options, giveUp time.Time) (wait time.Duration, ok bool) {
	now := time.Now()
	if o.since.IsZero() {
		o.since = now
	}
	o.last = err
	if now.Sub(o.since) >= opts.ReconnectTimeout || !giveUp.IsZero() && !now.Before(giveUp) {
		return 0, false
	}
	d := min(50*time.Millisecond<<min(o.attempts, 16), opts.MaxBackoff)
	o.attempts++
	d = time.Duration(float64(d) * (0.8 + 0.4*rand.Float64())) // jitter keeps many clients apart
	if !giveUp.IsZero() {
		d = min(d, giveUp.Sub(now))
	}
	return d, true
}

// sleep waits d; it reports false if ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func (o *outage) reset() { *o = outage{} }

// newID returns a random id for a request or step the caller left without one.
func newID() string {
	var b [12]byte
	_, _ = crand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}
