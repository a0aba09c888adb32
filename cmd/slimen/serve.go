package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"maps"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
)

func init() {
	commands["serve"] = command{"serve a policy engine over gRPC for hosts elsewhere", cmdServe}
}

// serveEngines opens the Go engines `slimen serve` can expose, by --engine name.
var serveEngines = map[string]func(model string, threads int) (engines.Engine, error){
	"tiny": func(model string, threads int) (engines.Engine, error) {
		return tiny.Open(model, tiny.Options{Threads: threads})
	},
}

func cmdServe(args []string) int {
	f := newServeFlags()
	if err := f.fs.Parse(args); err != nil {
		return flagExit(err)
	}
	if f.fs.NArg() > 0 {
		f.fs.Usage()
		return 2
	}
	p, err := f.plan()
	if err != nil {
		fmt.Fprintf(os.Stderr, "slimen serve: %v\n", err)
		return 2
	}
	return p.serve()
}

// serveFlags are the flags of `slimen serve`.
type serveFlags struct {
	fs                                *flag.FlagSet
	kind, model, listen               *string
	roots                             rootFlag
	certFile, keyFile, clientCA       *string
	insecure                          *bool
	tokenEnv, cfgPath, policy, openai *string
	maxMB, threads                    *int
	window                            *time.Duration
	limits                            openaiLimits
}

func newServeFlags() *serveFlags {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	f := &serveFlags{fs: fs,
		kind:   fs.String("engine", "tiny", "engine to serve: "+strings.Join(slices.Sorted(maps.Keys(serveEngines)), ", ")),
		model:  fs.String("model", "builtin:tiny-arith", "model to load: a Hugging Face folder or builtin:NAME"),
		listen: fs.String("listen", "127.0.0.1:7777", "host:port to listen on; anything but loopback needs TLS or --insecure, and --token-env or --tls-client-ca"),
	}
	fs.Var(&f.roots, "root", "folder that clients' Save and Load may use (repeatable; relative paths are taken from the first; default: the current directory)")
	f.certFile = fs.String("tls-cert", "", "PEM certificate to serve TLS with (with --tls-key)")
	f.keyFile = fs.String("tls-key", "", "PEM private key of --tls-cert")
	f.clientCA = fs.String("tls-client-ca", "", "PEM CAs that sign client certificates: require mutual TLS")
	f.insecure = fs.Bool("insecure", false, "allow plaintext on a non-loopback address (a private network, or a TLS proxy in front)")
	f.tokenEnv = fs.String("token-env", "", "environment variable holding the bearer token clients must send")
	f.maxMB = fs.Int("max-message-mb", server.DefaultMaxMessageBytes>>20, "largest message accepted or sent, in MiB")
	f.threads = fs.Int("threads", 0, "tiny: goroutines for the math (0: all cores)")
	f.window = fs.Duration("batch-window", 0, "how long a generate request waits for others to batch with (0: start at once)")
	f.cfgPath = fs.String("config", "", "serve the engine of a policy of this run config instead of --engine/--model: "+
		"any kind a run opens (tiny, torch, remote, openai); with --policy")
	f.policy = fs.String("policy", "", "with --config: the policy whose engine to serve (default: the config's only policy)")
	f.openai = fs.String("openai", "", "also serve an OpenAI-compatible HTTP API (/v1/chat/completions, …) on host:port, "+
		"with the same TLS, token and loopback rule")
	fs.Int64Var(&f.limits.requestTokens, "openai-max-request-tokens", 0, "--openai: the most tokens one request may ask for, "+
		"its prompts' and n × max_tokens for each (0: 1Mi, or 128 × the context length if more)")
	fs.Int64Var(&f.limits.requestSamples, "openai-max-request-samples", 0, "--openai: the most samples (prompts × n) one request may ask for (0: 4096)")
	fs.Int64Var(&f.limits.inFlight, "openai-max-tokens-in-flight", 0, "--openai: the most tokens, counted so, "+
		"of the requests answered at once; past it, or past 4 × --openai-max-request-samples samples, "+
		"a request gets 429 (0: 4 × --openai-max-request-tokens)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen serve [--engine tiny] [--model M | --config C [--policy P]] [--listen ADDR] "+
			"[--root DIR] [--tls-cert C --tls-key K [--tls-client-ca CA]] [--insecure] [--token-env VAR] [--openai ADDR]")
		fs.PrintDefaults()
	}
	return f
}

// servePlan is what `slimen serve` is to do, its flags checked: the engine to open (kind and
// model, as the log names them) and the servers' addresses and options.
type servePlan struct {
	kind, model string
	open        func(model string, threads int) (engines.Engine, error)
	threads     int
	policy      bool // --config: model is the policy's name, which requests may give
	listen      string
	openai      string // "": no OpenAI-compatible front
	limits      openaiLimits
	opts        server.Options
	tokenEnv    string
}

// plan checks the parsed flags and reads --config, --root, --token-env and the TLS files.
func (f *serveFlags) plan() (*servePlan, error) {
	p := &servePlan{kind: *f.kind, model: *f.model, threads: *f.threads, listen: *f.listen, openai: *f.openai, limits: f.limits, tokenEnv: *f.tokenEnv}
	var ok bool
	if p.open, ok = serveEngines[p.kind]; !ok {
		return nil, fmt.Errorf("unknown engine %q; this binary serves: %s", p.kind, strings.Join(slices.Sorted(maps.Keys(serveEngines)), ", "))
	}
	if *f.cfgPath != "" {
		if err := f.planPolicy(p); err != nil {
			return nil, err
		}
	} else if *f.policy != "" {
		return nil, errors.New("--policy names a policy of --config; give --config too")
	}
	if *f.maxMB < 1 {
		return nil, errors.New("--max-message-mb must be at least 1")
	}
	rootDirs, err := server.ResolveRoots(f.roots)
	if err != nil {
		return nil, err
	}
	for _, d := range rootDirs {
		if _, err := os.Stat(d); err != nil {
			return nil, fmt.Errorf("--root: %v; create the folder first", err)
		}
	}
	p.opts = server.Options{
		Roots:           rootDirs,
		Insecure:        *f.insecure,
		MaxMessageBytes: *f.maxMB << 20,
		BatchWindow:     *f.window,
		Logf:            log.Printf,
		Drain:           make(chan struct{}),
	}
	if p.tokenEnv != "" {
		if p.opts.Token = os.Getenv(p.tokenEnv); p.opts.Token == "" {
			return nil, fmt.Errorf("--token-env %s: the environment variable is empty or unset; export the token in it", p.tokenEnv)
		}
	}
	if *f.certFile != "" || *f.keyFile != "" || *f.clientCA != "" {
		if p.opts.TLS, err = server.TLSConfig(*f.certFile, *f.keyFile, *f.clientCA); err != nil {
			return nil, err
		}
	}
	if m := p.model; !p.policy && !strings.HasPrefix(m, "builtin:") && !filepath.IsAbs(m) {
		// The engine reports its model by this name (Info), and a host that resets the engine
		// to it asks to Load that name, which the server takes from its root, not from here.
		if abs, err := filepath.Abs(m); err == nil {
			p.model = abs
		}
	}
	return p, nil
}

// planPolicy makes p serve the engine of a policy of --config: --policy, or its only one.
func (f *serveFlags) planPolicy(p *servePlan) error {
	set := map[string]bool{}
	f.fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	if set["engine"] || set["model"] || set["threads"] {
		return errors.New("--config names the engine (its policy's engine: section); leave out --engine, --model and --threads")
	}
	cfg, err := config.Load(*f.cfgPath)
	if err != nil {
		return err
	}
	name := *f.policy
	if name == "" {
		if len(cfg.Policies) != 1 {
			return fmt.Errorf("--config %s defines %d policies; name the one to serve with --policy (%s)",
				*f.cfgPath, len(cfg.Policies), config.QuotePolicyNames(cfg.PolicyNames()))
		}
		name = cfg.Policies[0].Name
	}
	p.kind, p.model, p.policy = "policy", name, true
	p.open = func(string, int) (engines.Engine, error) {
		return host.OpenPolicyEngine(context.Background(), cfg, name, log.Printf)
	}
	return nil
}

// serve binds the addresses (before loading the model: a wrong address fails at once, not after
// a load), opens the engine and serves it until a signal, then lets the calls under way finish
// for up to 30 s. It returns the exit code.
func (p *servePlan) serve() int {
	l, err := server.Listen(p.listen, p.opts)
	if err != nil {
		fmt.Fprintf(os.Stderr, "slimen serve: %v\n", err)
		return 2
	}
	var hl net.Listener
	if p.openai != "" {
		if hl, err = listenOpenAI(p.openai, p.opts); err != nil {
			l.Close()
			fmt.Fprintf(os.Stderr, "slimen serve: --openai: %v\n", err)
			return 2
		}
		defer hl.Close()
	}
	eng, err := p.open(p.model, p.threads)
	if err != nil {
		l.Close()
		fmt.Fprintf(os.Stderr, "slimen serve: %v\n", err)
		return 2
	}
	defer eng.Close()
	srv := server.New(eng, p.opts)
	log.Printf("serving %s engine %s on %s (%s, protocol version %d); clients save and load model folders only under %s",
		p.kind, p.model, l.Addr(), p.security(), enginepb.ProtocolVersion, strings.Join(p.opts.Roots, ", "))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(l) }()
	if hl != nil {
		hs, err := p.serveOpenAI(eng, hl, errc)
		if err != nil {
			fmt.Fprintf(os.Stderr, "slimen serve: %v\n", err)
			return 1
		}
		defer func() { // requests under way finish, for up to 30 s, as on the gRPC side
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			hs.Shutdown(sctx)
		}()
	}
	select {
	case err := <-errc:
		fmt.Fprintf(os.Stderr, "slimen serve: %v\n", err)
		return 1
	case <-ctx.Done():
	}
	// Let calls under way finish (a train step, a batch being sampled), but not forever.
	log.Printf("stopping: waiting up to 30s for calls under way")
	close(p.opts.Drain)
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		srv.Stop()
	}
	return 0
}

// serveOpenAI serves eng's OpenAI-compatible front on hl; requests may name a served policy by
// its name.
func (p *servePlan) serveOpenAI(eng engines.Engine, hl net.Listener, errc chan<- error) (*http.Server, error) {
	var aliases []string
	if p.policy {
		aliases = []string{p.model} // --config C --policy P: requests may name the policy
	}
	hs, err := serveOpenAI(eng, hl, p.opts, p.limits, errc, aliases...)
	if err != nil {
		return nil, err
	}
	scheme := "http"
	if p.opts.TLS != nil {
		scheme = "https"
	}
	log.Printf("serving the OpenAI API at %s://%s/v1", scheme, hl.Addr())
	return hs, nil
}

// security describes the gRPC server's transport and key for the log: "TLS, token from $VAR".
func (p *servePlan) security() string {
	s := "plaintext"
	if p.opts.TLS != nil {
		s = "TLS"
		if p.opts.TLS.ClientCAs != nil {
			s = "mutual TLS"
		}
	}
	if p.opts.Token == "" {
		return s + ", no token"
	}
	return s + ", token from $" + p.tokenEnv
}

// rootFlag collects the --root folders, in order.
type rootFlag []string

func (r *rootFlag) String() string { return strings.Join(*r, ", ") }

func (r *rootFlag) Set(s string) error {
	if s == "" {
		return errors.New("an empty folder name")
	}
	*r = append(*r, s)
	return nil
}
