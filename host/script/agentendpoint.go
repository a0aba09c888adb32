package script

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/openai"
	"github.com/slimen/slimen/host/jail"
)

// This file defines the endpoint agent() programs talk to: one per run, not one per process.

// AgentEndpoint is the loopback OpenAI-compatible endpoint of one run's agent() programs: an HTTP
// server, started at the run's first agent() call, that routes each call by its API key to its
// agent() session, and the Unix socket that jailed programs' port leads to. The zero value is
// ready to use; Close stops it. A run owns one (Pass.Agents), so that two runs in one process
// share no server and no session.
type AgentEndpoint struct {
	mu       sync.Mutex
	closed   bool
	started  bool // the loopback server was started (url, err)
	url      string
	err      error
	handler  http.Handler
	servers  []*http.Server
	sessions map[string]*agentSession

	sockStarted bool // the socket was made (sock, sockErr)
	sock        string
	sockErr     error
}

// errAgentEndpointClosed is the error of an agent() call that starts after its run closed.
var errAgentEndpointClosed = errors.New("the run's agent endpoint is closed: the run has ended")

type agentSessionKey struct{}

// add routes the calls carrying key to s.
func (a *AgentEndpoint) add(key string, s *agentSession) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.sessions == nil {
		a.sessions = map[string]*agentSession{}
	}
	a.sessions[key] = s
}

// remove stops routing key's calls: they are answered 401 from then on.
func (a *AgentEndpoint) remove(key string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.sessions, key)
}

// session is the agent() session of a call's key; nil: none (ended, or never given).
func (a *AgentEndpoint) session(key string) *agentSession {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.sessions[key]
}

// URL returns the root of the endpoint ("http://127.0.0.1:PORT"), starting it.
func (a *AgentEndpoint) URL() (string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.startLocked()
}

func (a *AgentEndpoint) startLocked() (string, error) {
	if a.closed {
		return "", errAgentEndpointClosed
	}
	if a.started {
		return a.url, a.err
	}
	a.started = true
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		a.err = fmt.Errorf("cannot listen on loopback for the agent endpoint: %v", err)
		return "", a.err
	}
	a.url = "http://" + ln.Addr().String()
	a.handler = a.newHandler()
	a.serveLocked(ln)
	return a.url, nil
}

// newHandler is the endpoint's front: the chat path of engines/openai, whose backend is the
// session of the call's key (checked before anything of the body is read).
func (a *AgentEndpoint) newHandler() http.Handler {
	// Each program's /v1/models lists the name it was given ($OPENAI_MODEL): its policy's.
	modelFor := func(r *http.Request) string { return r.Context().Value(agentSessionKey{}).(*agentSession).policy }
	front := openai.NewChatHandler(openai.HandlerOptions{Model: "slimen-policy", ModelFor: modelFor},
		func(ctx context.Context, call openai.ChatCall) ([]engines.Completion, error) {
			return ctx.Value(agentSessionKey{}).(*agentSession).complete(call)
		})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := openai.BearerToken(r)
		s := a.session(key)
		if s == nil {
			openai.Unauthorized(w, "this endpoint answers the programs agent() runs, each with the OPENAI_API_KEY it was given; "+
				"the request carried none, or the key of an agent() call that has ended")
			return
		}
		front.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), agentSessionKey{}, s)))
	})
}

func (a *AgentEndpoint) serveLocked(ln net.Listener) {
	srv := openai.NewServer(a.handler)
	a.servers = append(a.servers, srv)
	go srv.Serve(ln)
}

// Socket returns the Unix socket of the endpoint, which jails lead their port to, serving it at
// the first call: in a folder of its own that only this process's user can open.
func (a *AgentEndpoint) Socket() (string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, err := a.startLocked(); err != nil {
		return "", err
	}
	if a.sockStarted {
		return a.sock, a.sockErr
	}
	a.sockStarted = true
	jail.SweepOrphans(os.TempDir(), "slimen-agents-", func(d string) { os.RemoveAll(d) }) // killed sandbox children's
	dir, err := os.MkdirTemp("", fmt.Sprintf("slimen-agents-%d-", os.Getpid()))
	if err != nil {
		a.sockErr = fmt.Errorf("cannot make the agent endpoint's socket: %v", err)
		return "", a.sockErr
	}
	a.sock = filepath.Join(dir, "endpoint.sock")
	ln, err := net.Listen("unix", a.sock)
	if err != nil {
		a.sockErr = fmt.Errorf("cannot listen on the agent endpoint's socket: %v", err)
		return "", a.sockErr
	}
	a.serveLocked(ln)
	return a.sock, nil
}

// Close stops the endpoint's servers (their connections with them) and removes its socket's
// folder; an agent() call after it fails. Closing an endpoint never started, or closed, is a
// no-op.
func (a *AgentEndpoint) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	a.closed = true
	var errs []error
	for _, srv := range a.servers {
		errs = append(errs, srv.Close())
	}
	if a.sock != "" {
		errs = append(errs, os.RemoveAll(filepath.Dir(a.sock)))
	}
	return errors.Join(errs...)
}
